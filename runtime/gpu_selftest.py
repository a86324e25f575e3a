"""Loading a bundle's CUDA module, and its model-level self-test at first load.

A GPU kernel that computes wrong numbers does not crash. So before the model serves, the bundle's
fixed prompt (compiler/gpu_reference.py) runs through the GPU module and its logits are compared,
position by position, with the CPU module's that the build stored. A GPU that disagrees (cosine
below the manifest's bar anywhere) is not used: the model runs on its CPU module, with one
`WARN: self-test:` line; a bundle with no CPU module refuses to load instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from goinfer.artifacts import giw
from goinfer.artifacts.manifest import Manifest

from . import cuda, selftest
from . import tvm_runtime as rt
from .selftest import SelfTestError, SelfTestResult


def load_cuda(
    bundle: giw.Bundle, m: Manifest, lib_dir: Path, enabled: bool, say: Callable[[str], None]
) -> tuple[object | None, object | None, SelfTestResult]:
    """(vm, params, result) on cuda:0, the weights copied to the device once; (None, None, result)
    when the self-test found the GPU wrong and the bundle has a CPU module to run instead."""
    gpu = next(g for g in m.gpu_modules if g.kind == "cuda")
    if gpu.kernels:
        cuda.serve_prebuilt_kernels({gpu.kernels_source_sha256: bytes(bundle.module_bytes(gpu.kernels))})
    library = str(bundle.extract_module(gpu.module, lib_dir))
    try:
        vm = rt.load_vm(library, "cuda")
    except Exception as e:  # TVM's error from the device (memory, driver): one line, no backtrace
        raise cuda.CudaError(
            f"CUDA: cannot start the {gpu.arch} module on cuda:0: {cuda.first_line(e)}"
        ) from None
    params = rt.tensor_list([cuda.upload(bundle.tensor(name)) for name in m.params])
    if not enabled:
        result = SelfTestResult("cuda", "skipped", gpu.arch, 0.0, reason="disabled (--no-selftest)")
        selftest.RESULTS.append(result)
        return vm, params, result
    t0 = time.perf_counter()
    test = m.gpu_selftest
    try:
        got = prompt_logits(vm, params, m, bundle.tensor(test.prompt))
    except cuda.CudaError:
        raise
    except Exception as e:  # a kernel that faults (launch failure, illegal address)
        raise cuda.CudaError(
            f"CUDA: the {gpu.arch} module failed its test prompt: {cuda.first_line(e)}"
        ) from None
    cos = cosines(got, np.asarray(bundle.tensor(test.want), np.float32))
    ms = (time.perf_counter() - t0) * 1e3
    worst = float(cos.min()) if np.isfinite(cos).all() else float("-inf")
    if worst >= test.min_cosine:
        result = SelfTestResult("cuda", "pass", gpu.arch, ms)
        selftest.RESULTS.append(result)
        return vm, params, result
    mismatch = {"kernel": "model", "tier": gpu.arch, "observed": 1 - worst, "allowed": 1 - test.min_cosine}
    fallback = "running on the CPU module" if m.cpu_tiers else "the bundle has no CPU module"
    say(
        f"WARN: self-test: the {gpu.arch} CUDA module's logits for the test prompt differ from the CPU "
        f"module's (min cosine {worst:.4f} < {test.min_cosine}); {fallback}"
    )
    result = SelfTestResult("cuda", "declined", None, ms, [mismatch], [gpu.arch])
    selftest.RESULTS.append(result)
    if not m.cpu_tiers:
        raise SelfTestError(
            "self-test: the CUDA module computes wrong logits on this GPU; refusing to return wrong numbers "
            "(GOINFER_NO_SELFTEST=1 skips the check)"
        )
    return None, None, result


def prompt_logits(vm, params, m: Manifest, ids: np.ndarray) -> np.ndarray:
    """Every position's logits for `ids` from a fresh cache, fed in the manifest's chunks."""
    page, chunk = m.kv_cache.page_size, m.kv_cache.prefill_chunk
    kv = rt.create_kv_cache(vm, 1, len(ids) + page, chunk, page)
    rt.add_sequence(kv, 0)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = np.asarray(ids[start : start + chunk], np.int32)
        rt.begin_forward(kv, [0], [len(piece)])
        rows.append(cuda.download(vm["prefill_all"](cuda.upload(piece), kv, params))[0])
        rt.end_forward(kv)
    return np.concatenate(rows)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of a with the same row of b."""
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return (a * b).sum(-1) / np.where(norms > 0, norms, 1.0)
