"""The numpy reference forward pass (tests/reference) against llama.cpp (tests/goldens/reference_*.json).

The goldens come from tests/goldens/record_reference.py; these tests need no llama.cpp. Two checks
per real model, both on llama.cpp's top-10 raw log-probs at every position of a ~20-token prompt:

* the quantized GGUF itself. llama.cpp rounds each matmul input to 8 bits for quantized weights,
  and over many layers that rounding is chaotic (a 1e-7 nudge moves log-probs by ~0.1), so only
  top-1 agreement and a loose |Δlogprob| can be asked for;
* a float32 copy of its first blocks (tests/reference/derive.py; gemma's with a 4-token sliding
  window and pattern 3). llama.cpp then does float32 math and the reference must agree to 1e-2,
  which a wrong window edge, rope base, attention scale or swa pattern misses by 0.3 to 9.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from goinfer.artifacts import cache
from reference import attention_mask, load, reference_logits
from reference import forward as ref
from reference.derive import derive_f32_gguf

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
MODELS_DIR = cache.folder("models")
NAMES = ("qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m")

# |Δ| = |reference - llama.cpp| in natural-log probability. Measured at recording time (exact math):
# quantized top token max 0.06 / 0.12 / 0.21 (qwen / gemma / smollm2), top-5 max ~0.4, mean top
# token 0.02-0.04; derived float32 top-5 max 0.004 / 0.005 / 0.002, and with llama_cpp_rounding
# 0.0007 / 0.002 / 0.0002.
QUANT_TOP_TOKEN = 0.3
QUANT_TOP5 = 0.6
QUANT_MEAN_TOP_TOKEN = 0.08
DERIVED_EXACT_TOP5 = 0.02  # exact math; llama.cpp's fp16 GELU table and f16 lm-head input remain
DERIVED_ROUNDED_TOP5 = 0.01  # mirroring those, what is left is float32 noise through fp16 GELU
NEAR_TIE = 0.05  # llama.cpp's own top-2 gap below which a top-1 swap is not a disagreement


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _compare(logits: np.ndarray, steps: list[dict[str, Any]]) -> dict[str, Any]:
    lp = _log_softmax(logits)
    top1 = ties = 0
    d_top, d_top5 = [], []
    for step in steps:
        p = step["position"]
        ids = [int(t[0]) for t in step["top"][:5]]
        want = np.array([t[1] for t in step["top"][:5]])
        if int(lp[p].argmax()) == ids[0]:
            top1 += 1
        elif want[0] - want[1] < NEAR_TIE:
            ties += 1
        d = np.abs(lp[p, ids] - want)
        d_top.append(d[0])
        d_top5.append(d.max())
    return {
        "positions": len(steps),
        "top1": top1,
        "near_tie_swaps": ties,
        "max_top_token": float(max(d_top)),
        "mean_top_token": float(np.mean(d_top)),
        "max_top5": float(max(d_top5)),
    }


def _fmt(fig: dict[str, Any]) -> str:
    return (
        f"top1 {fig['top1']}/{fig['positions']} (near-tie swaps {fig['near_tie_swaps']}), "
        f"|Δlogprob| top token max {fig['max_top_token']:.4f} mean {fig['mean_top_token']:.4f}, "
        f"top-5 max {fig['max_top5']:.4f}"
    )


# Module scope groups the tests by model, so the lru_cache in reference.forward keeps one model's
# dequantized weights between its two tests.
@pytest.fixture(scope="module", params=NAMES)
def golden(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Path]:
    name = request.param
    gpath = GOLDENS / f"reference_{name}.json"
    if not gpath.is_file():
        pytest.skip(f"no golden {gpath.name}; run tests/goldens/record_reference.py")
    g = json.loads(gpath.read_text())
    model = MODELS_DIR / g["gguf"]
    if not model.is_file():
        pytest.skip(f"model {model} not present")
    if model.stat().st_size != g["gguf_size"]:
        pytest.skip(f"{model} is not the file the golden was recorded from")
    return g, model


@pytest.mark.slow
def test_quantized_model_matches_llama_cpp(golden: tuple[dict[str, Any], Path]) -> None:
    g, model = golden
    fig = _compare(reference_logits(model, g["token_ids"]), g["quantized"]["steps"])
    print(f"\n{g['model']} quantized: {_fmt(fig)}")
    assert fig["top1"] + fig["near_tie_swaps"] == fig["positions"], fig
    assert fig["max_top_token"] < QUANT_TOP_TOKEN, fig
    assert fig["mean_top_token"] < QUANT_MEAN_TOP_TOKEN, fig
    assert fig["max_top5"] < QUANT_TOP5, fig


@pytest.mark.slow
def test_float32_derived_model_matches_llama_cpp(golden: tuple[dict[str, Any], Path], tmp_path: Path) -> None:
    g, model = golden
    d = g["derived"]
    path = tmp_path / f"{g['model']}-f32.gguf"
    derive_f32_gguf(load(model).reader, path, d["n_layer"], d["overrides"])
    try:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        assert h.hexdigest() == d["sha256"], "derive_f32_gguf changed; re-record the goldens"
        exact = _compare(reference_logits(path, g["token_ids"]), d["steps"])
        rounded = _compare(reference_logits(path, g["token_ids"], llama_cpp_rounding=True), d["steps"])
    finally:
        path.unlink()  # ~0.5 GB for gemma; an open memmap keeps working
    print(f"\n{g['model']} float32 derived, exact: {_fmt(exact)}")
    print(f"{g['model']} float32 derived, llama_cpp_rounding: {_fmt(rounded)}")
    for fig in (exact, rounded):
        assert fig["top1"] + fig["near_tie_swaps"] == fig["positions"], fig
    assert exact["max_top5"] < DERIVED_EXACT_TOP5, exact
    assert rounded["max_top5"] < DERIVED_ROUNDED_TOP5, rounded


# --- no model files needed -------------------------------------------------------------------------


def _hparams(neox: bool, n_rot: int) -> ref.HParams:
    return ref.HParams(
        arch="llama", n_layer=1, n_embd=n_rot, n_head=1, n_head_kv=1, head_dim_k=n_rot,
        head_dim_v=n_rot, n_rot=n_rot, eps=1e-6, neox=neox, rope_base=10000.0, rope_freq_scale=1.0,
        swa_window=0, swa_layers=(False,), rope_base_swa=10000.0, attn_scale=1.0, logit_softcap=0.0,
    )  # fmt: skip


def test_norm_rope_on_gguf_rows_is_neox_rope_on_hf_rows() -> None:
    # convert_hf_to_gguf permutes llama's Q/K rows from HF's half-split layout to interleaved pairs,
    # so that llama.cpp's NORM rope on the GGUF equals HF's rotate_half (NEOX) rope on the original.
    rng = np.random.default_rng(0)
    d = 16
    hf = rng.standard_normal((5, 3, d))

    def to_gguf(x: np.ndarray) -> np.ndarray:
        return x.reshape(*x.shape[:-1], 2, d // 2).swapaxes(-1, -2).reshape(x.shape)

    pos = np.arange(5)
    neox = ref._rope(hf, pos, _hparams(True, d), 10000.0, 1.0, None)
    norm = ref._rope(to_gguf(hf), pos, _hparams(False, d), 10000.0, 1.0, None)
    np.testing.assert_allclose(norm, to_gguf(neox), rtol=0, atol=1e-12)


def test_sliding_window_mask() -> None:
    # is_masked_swa: masked when q - k >= window; a query sees itself and window-1 keys back.
    want = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=bool
    )
    np.testing.assert_array_equal(attention_mask(5, 2), want)
    np.testing.assert_array_equal(attention_mask(5, 0), np.tril(np.ones((5, 5), dtype=bool)))


def _tiny_gguf(path: Path, arch: str, rng: np.random.Generator, window: int = 0) -> None:
    """Random weights, no tokenizer: the reference reads only hparams and tensors."""
    n_embd, n_head, n_kv, hd, n_ff, n_vocab, n_layer = 32, 4, 2, 8, 48, 64, 2
    w = GGUFWriter(path, arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        if window:
            w.add_sliding_window(window)
            pattern = [True] * n_layer
            w.add_key_value(
                f"{arch}.attention.sliding_window_pattern", pattern, GGUFValueType.ARRAY, GGUFValueType.BOOL
            )

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * (1.0 if len(shape) == 1 else 0.3))

    t("token_embd.weight", n_vocab, n_embd)
    t("output_norm.weight", n_embd)
    for il in range(n_layer):
        b = f"blk.{il}"
        t(f"{b}.attn_norm.weight", n_embd)
        t(f"{b}.attn_q.weight", n_head * hd, n_embd)
        t(f"{b}.attn_k.weight", n_kv * hd, n_embd)
        t(f"{b}.attn_v.weight", n_kv * hd, n_embd)
        t(f"{b}.attn_output.weight", n_embd, n_head * hd)
        t(f"{b}.ffn_norm.weight", n_embd)
        t(f"{b}.ffn_gate.weight", n_ff, n_embd)
        t(f"{b}.ffn_up.weight", n_ff, n_embd)
        t(f"{b}.ffn_down.weight", n_embd, n_ff)
        if arch == "qwen2":
            t(f"{b}.attn_q.bias", n_head * hd)
            t(f"{b}.attn_k.bias", n_kv * hd)
            t(f"{b}.attn_v.bias", n_kv * hd)
        if arch == "gemma3":
            t(f"{b}.attn_q_norm.weight", hd)
            t(f"{b}.attn_k_norm.weight", hd)
            t(f"{b}.post_attention_norm.weight", n_embd)
            t(f"{b}.post_ffw_norm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_model_is_causal(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    _tiny_gguf(path, arch, np.random.default_rng(1))
    ids = [3, 17, 5, 60, 1, 9, 33]
    full = reference_logits(path, ids)
    assert full.shape == (len(ids), 64) and full.dtype == np.float32 and np.isfinite(full).all()
    np.testing.assert_allclose(reference_logits(path, ids[:4]), full[:4], rtol=1e-5, atol=1e-5)
    assert not np.allclose(reference_logits(path, [4, *ids[1:]])[-1], full[-1])  # early tokens matter


def test_tiny_gemma3_sliding_window_reach(tmp_path: Path) -> None:
    # Two sliding layers with window 2: position p sees p-1 in each, so p depends on p-2..p only.
    path = tmp_path / "gemma3_swa.gguf"
    _tiny_gguf(path, "gemma3", np.random.default_rng(2), window=2)
    assert load(path).hp.swa_layers == (True, True)
    ids = [3, 17, 5, 60, 1, 9]
    base = reference_logits(path, ids)
    changed = reference_logits(path, [40, *ids[1:]])  # token 0 differs
    np.testing.assert_allclose(changed[3:], base[3:], rtol=0, atol=1e-6)
    assert not np.allclose(changed[2], base[2])


def test_q8_rounding_error_is_half_a_step() -> None:
    x = np.random.default_rng(3).standard_normal((4, 512)) * 3
    for fmt, block in (("q8_0", 32), ("q8_1", 32), ("q8_K", 256)):
        xr, _ = ref._round_activations(x, fmt)
        xb = x.reshape(4, -1, block)
        step = np.abs(xb).max(axis=-1, keepdims=True) / 127
        # half a step, plus the fp16 rounding of the q8_0/q8_1 scale
        assert (np.abs(xr.reshape(xb.shape) - xb) <= step * (0.5 + 127 * 2**-11)).all(), fmt
