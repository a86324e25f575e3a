"""The GPU self-test's fixture: a short fixed prompt and the logits the CPU module gives for it.

A bundle with a GPU module carries both; the runtime runs the prompt on the GPU at first load and
falls back to the CPU where the two disagree (runtime/gpu_selftest.py). The CPU module is the
reference because it is itself checked: against numpy in the tests, by its kernel self-test on
every machine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from goinfer.artifacts import manifest

PROMPT_TOKENS = 8
MIN_COSINE = 0.995  # per position, GPU logits against the CPU module's
IDS_TENSOR = "selftest.gpu.prompt"
LOGITS_TENSOR = "selftest.gpu.logits"


def prompt_ids(vocab_size: int) -> np.ndarray:
    """Fixed token ids spread over the vocabulary (no tokenizer needed, the same every build)."""
    return (np.arange(1, PROMPT_TOKENS + 1, dtype=np.int64) * 7919 % vocab_size).astype(np.int32)


def cpu_logits(library: bytes, params: list[np.ndarray], ids: np.ndarray, kv: manifest.KVCache) -> np.ndarray:
    """Every position's logits from the CPU module, (len(ids), vocab) float32, a `decode` step a
    token: on the CPU a token's logits are the same bits whichever entry point computes them
    (kernels/attention.py), and the CPU cache's prefill attention only runs as the runtime routes
    it (runtime/tvm_runtime.py), which the compiler does not import."""
    import tvm
    from tvm import relax
    from tvm.runtime import ShapeTuple

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.so"
        path.write_bytes(library)
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    cache = vm["create_kv_cache"](
        ShapeTuple([1]),
        ShapeTuple([len(ids) + kv.page_size]),
        ShapeTuple([kv.prefill_chunk]),
        ShapeTuple([kv.page_size]),
    )
    builtin = tvm.get_global_func
    builtin("vm.builtin.kv_state_add_sequence")(cache, 0)
    weights = [tvm.runtime.tensor(p) for p in params]
    rows = []
    for token in ids:
        builtin("vm.builtin.kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([1]))
        logits = vm["decode"](tvm.runtime.tensor(np.asarray([token], np.int32)), cache, weights).numpy()
        rows.append(logits.reshape(-1, logits.shape[-1])[-1])
        builtin("vm.builtin.kv_state_end_forward")(cache)
    return np.stack(rows).astype(np.float32)


def tensors(library: bytes, params: list[np.ndarray], vocab_size: int, kv: manifest.KVCache):
    """The fixture's (name, array) pairs and its manifest entry."""
    ids = prompt_ids(vocab_size)
    logits = cpu_logits(library, params, ids, kv)
    entry = manifest.GpuSelfTest(prompt=IDS_TENSOR, want=LOGITS_TENSOR, min_cosine=MIN_COSINE)
    return [(IDS_TENSOR, ids), (LOGITS_TENSOR, logits)], entry
