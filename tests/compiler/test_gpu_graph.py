"""The GPU graph's numerics, checked on this CPU.

A CUDA bundle runs a different graph from the CPU's: each block in its plain form (kernels/device.py,
Relax's norm) with float16 matmul operands for quantized weights, scheduled by dlight's GPU rules.
No GPU is needed to check what that graph computes: exported the same way but compiled for the
CPU, it must match the numpy reference as the CPU graph does. Attention is the one part swapped: the
cache's stock CPU kernels go wrong with sliding windows (NaN from gemma3's third chunk), so ours
run it, as in every CPU bundle. What remains GPU-only is dlight's scheduling of the graph and the
cache's stock GPU attention, which tests/gpu/run.sh checks on a device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numerics_bars import F32_MIN_COSINE, INT_BARS
from reference import reference_logits
from tiny_gguf import NEW_MODELS, ORIGINAL_CONTEXT

FAMILIES = ("llama", "qwen2", "gemma3")
# Against the numpy reference of the same file. f32: as the CPU graph's bar. gguf Q8_0 keeps the
# file's weights exactly; only the float16 operands differ (measured: 0.99996 - 0.99999).
F32_BAR, Q8_BAR = F32_MIN_COSINE, 0.9995
# int4 against the f32 reference: the CPU's own bar for int4.
INT4_BAR = INT_BARS["int4"][0]


def _gpu_graph_on_cpu_logits(gguf, quant: str, ids: list[int]) -> np.ndarray:
    import tempfile
    from pathlib import Path

    from goinfer.compiler import gpu_reference
    from goinfer.compiler.build import _pack_weights, kv_cache
    from goinfer.compiler.kernels import attention, kv_append
    from goinfer.compiler.models import layer
    from goinfer.compiler.models.decoder import build_model
    from goinfer.compiler.models.layers import gpu_graph
    from goinfer.compiler.quant import scheme_for
    from goinfer.compiler.sources import load_checkpoint
    from goinfer.compiler.tvm import export, graph, schedules, targets

    ckpt = load_checkpoint(gguf)
    host = targets.host_target(2)
    model = build_model(
        ckpt.spec, layer(ckpt.spec.family), lambda p: scheme_for(quant, p), ckpt.tensors, host, "float32"
    )
    tensors, _ = _pack_weights(model, ckpt, lambda _m: None)
    with gpu_graph():
        mod, params = graph.export(model, model.export_spec())
    s = ckpt.spec
    mod = attention.use_ours(mod, s.num_kv_heads, s.num_heads, s.head_dim, graph.kv_window(s))
    mod = kv_append.use_ours(mod, s.num_kv_heads, s.num_heads, s.head_dim)
    # Numerics only: every kernel as written, its outer loop in parallel (dlight's CPU rules would
    # vectorize the dequantizing matmuls into very long LLVM codegen, for speed nobody needs here)
    executable = export.compile_module(mod, targets.make_target(host), [schedules.ParallelFallback()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpu_graph.so"
        export.export_library(executable, str(path))
        library = path.read_bytes()
    weights = [tensors[name] for name, _ in params]
    return gpu_reference.cpu_logits(
        library, weights, np.asarray(ids, np.int32), kv_cache(ckpt.spec, "float32")
    )


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _ids(vocab: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(7).integers(3, vocab, 12)]


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_graph_f32_matches_numpy_reference(family, tiny_gguf) -> None:
    gguf = tiny_gguf(family)
    ref = reference_logits(gguf, ids := _ids(_vocab(gguf)))
    cos = _cos(_gpu_graph_on_cpu_logits(gguf, "f32", ids), ref)
    print(f"\n{family} GPU graph f32 vs reference: min cosine {cos.min():.6f}")
    assert cos.min() >= F32_BAR


@pytest.mark.parametrize("model", NEW_MODELS)
def test_gpu_graph_f32_matches_numpy_reference_on_the_newer_families(model, tiny_gguf) -> None:
    """qwen3's q/k norms, the scaled RoPEs' tables, phi3's fused weights and partial rotary, the
    windows over every layer: past the original context (64) and the windows (8, 48)."""
    gguf = tiny_gguf(model)
    ids = [int(i) for i in np.random.default_rng(7).integers(3, _vocab(gguf), 2 * ORIGINAL_CONTEXT + 8)]
    cos = _cos(_gpu_graph_on_cpu_logits(gguf, "f32", ids), reference_logits(gguf, ids))
    print(f"\n{model} GPU graph f32 vs reference: min cosine {cos.min():.6f}")
    assert cos.min() >= F32_BAR


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_graph_gguf_q8_matches_its_file(family, tiny_gguf) -> None:
    gguf = tiny_gguf(family, "Q8_0")
    ref = reference_logits(gguf, ids := _ids(_vocab(gguf)))
    ours = _gpu_graph_on_cpu_logits(gguf, "gguf", ids)
    cos = _cos(ours, ref)
    print(f"\n{family} GPU graph gguf Q8_0 (float16 operands) vs reference: min cosine {cos.min():.6f}")
    assert cos.min() >= Q8_BAR
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gpu_graph_runs_a_split_qkv(tiny_gguf) -> None:
    """Q5_0 q and k beside a Q8_0 v: a matmul each, their outputs concatenated, as on the CPU."""
    gguf = tiny_gguf("qwen2", "Q5_0+Q8_0:attn_v")
    ref = reference_logits(gguf, ids := _ids(_vocab(gguf)))
    ours = _gpu_graph_on_cpu_logits(gguf, "gguf", ids)
    assert _cos(ours, ref).min() >= Q8_BAR
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gpu_graph_int4_holds_the_cpu_bar(tiny_gguf) -> None:
    gguf = tiny_gguf("qwen2")
    ref = reference_logits(gguf, ids := _ids(_vocab(gguf)))
    cos = _cos(_gpu_graph_on_cpu_logits(gguf, "int4", ids), ref)
    print(f"\nqwen2 GPU graph int4 vs f32 reference: min cosine {cos.min():.4f}")
    assert cos.min() >= INT4_BAR


def _vocab(gguf) -> int:
    from goinfer.compiler.sources import load_checkpoint

    return load_checkpoint(gguf).spec.vocab_size


@pytest.mark.parametrize("scheme", ["f32", "int8", "int8int8", "int4", "gguf:q6_k", "gguf:q5_k"])
def test_decode_gemv_schedules_every_weight_layout(scheme: str) -> None:
    """A decode step's linear on the GPU is our dequant-fused GEMV for every layout (dlight's own
    GEMV takes none of the packed ones): thread blocks of 16 rows x 16 k-threads, one
    cross-thread sum, and the weights read packed (no dequantized copy written)."""
    import tvm
    from goinfer.compiler.kernels import affine, device
    from goinfer.compiler.quant import SCHEMES
    from goinfer.compiler.quant import affine as packing
    from goinfer.compiler.tvm import schedules, targets
    from tvm import te, tirx

    if scheme.startswith("gguf:"):
        q6 = scheme == "gguf:q6_k"  # Q6_K: two high-bit planes; Q5_K: one, and a min
        layout = affine.Layout(
            bits=6 if q6 else 5, group=16 if q6 else 32, code="int8", has_min=not q6, zero=32 if q6 else 0
        )
        take, specs = affine.take(layout), packing.param_specs(layout, 896, 4864)
    else:
        take, specs = SCHEMES[scheme].take, SCHEMES[scheme].param_specs(896, 4864)
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    x = te.placeholder((i64(1), i64(4864)), "float32", name="x")
    params = [te.placeholder([i64(v) for v in shape], dtype, name=n) for n, (shape, dtype) in specs.items()]
    y = device.linear(take, 896, 4864, scheme != "f32")(x, *params)
    target = targets.make_target(targets.cuda_target())
    with target:
        sch = schedules.DecodeGEMV().apply(te.create_prim_func([x, *params, y]), target, False)
        assert sch is not None
        source = targets.cuda_source(tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target))
    kernels = set(re.findall(r"__global__ void __launch_bounds__\((\d+)\) (\w+)", source))
    assert kernels == {("256", "main_kernel")}  # one kernel: 16 rows x 16 k-threads
    assert "red_buf" in source  # the cross-thread sum over the k-threads
