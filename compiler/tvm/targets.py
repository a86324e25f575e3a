"""What the compiler builds for: the host CPU and its ISA tiers, CUDA and Metal targets, and the
CUDA compiler. TVM calls that change between releases live in compiler/tvm/ (written against TVM
0.27); if an upgrade breaks the build, look here, in passes.py, graph.py, export.py and
schedules.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import tvm
import tvm_ffi
from tvm.target import Target, codegen

__all__ = ["Target", "cpu_tiers", "cuda_target", "host_target", "make_target", "metal_target"]

TVM_VERSION: str = tvm.__version__


# These VMs advertise AMX, but its instructions fault (SIGILL): never let LLVM emit them.
_NO_AMX = ("-amx-tile", "-amx-int8", "-amx-bf16", "-amx-fp16", "-amx-complex")


def host_target(num_cores: int | None = None) -> dict[str, Any]:
    """The host CPU as a target dict: its ISA, its core count, and AMX switched off."""
    import os

    return {
        "kind": "llvm",
        "mtriple": "x86_64-linux-gnu",
        "mcpu": codegen.llvm_get_system_cpu(),
        "mattr": list(_NO_AMX),
        "num-cores": num_cores or os.cpu_count() or 1,
    }


def make_target(target: dict[str, Any]) -> Target:
    return Target(target)


# -- GPU targets ----------------------------------------------------------------------------------
DEFAULT_CUDA_ARCH = "sm_90"  # the H200/H100; its PTX is embedded too, so newer GPUs can JIT it


def cuda_target(arch: str = DEFAULT_CUDA_ARCH, num_cores: int | None = None) -> dict[str, Any]:
    """A CUDA GPU of compute capability `arch` ("sm_90"), the host side for this CPU."""
    return {
        "kind": "cuda",
        "arch": arch,
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32,
        "host": host_target(num_cores),
    }


# Metal's vector types stop at 4 lanes: codegen refuses float16x8, so schedules for it must not
# vectorize wider (see passes.cap_vector_lanes).
METAL_MAX_LANES = 4


def metal_target() -> dict[str, Any]:
    """An Apple-silicon GPU; the host side is arm64 macOS, linked on the Mac that loads it."""
    return {
        "kind": "metal",
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 32768,
        "thread_warp_size": 32,
        "host": {"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"},
    }


@contextlib.contextmanager
def cuda_compiler() -> Iterator[None]:
    """Where TVM compiles CUDA itself (a host whose CUDA runtime is loaded), compile to
    `compile_cuda_source`'s fatbin rather than TVM's default single-arch NVRTC cubin."""
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    tvm_ffi.register_global_func(
        "tvm_callback_cuda_compile", lambda code: compile_cuda_source(code, Target.current()), override=True
    )
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous, override=True)


def cuda_source(executable) -> str:
    """The CUDA C++ of a compiled executable's kernels. Without a loaded CUDA runtime (any host
    without a driver) TVM 0.27 keeps the kernels as source, to be compiled when the module loads;
    the build compiles them now instead (`compile_cuda_source`)."""

    def walk(m):
        yield m
        for child in m.imports:
            yield from walk(child)

    found = [m for m in walk(executable.mod) if m.kind == "cuda"]
    return found[0].inspect_source("cuda") if found else ""


def _nvcc_path() -> str | None:
    from tvm.support import nvcc

    found = shutil.which("nvcc")
    if found:
        return found
    try:
        home = nvcc.find_cuda_path()
    except RuntimeError:
        return None
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def cuda_compiler_name() -> str | None:
    """The CUDA compiler here: "nvcc" (first: it embeds PTX), "nvrtc", or None for neither."""
    if _nvcc_path() is not None:
        return "nvcc"
    try:
        from cuda.bindings import nvrtc  # noqa: F401  (cuda-bindings and nvidia-cuda-nvrtc)
    except ImportError:
        return None
    return "nvrtc"


def compile_cuda_source(source: str, target: Target) -> bytes:
    """`source` compiled for `target`'s arch: with nvcc, a fatbin holding the arch's SASS and its
    PTX, so a newer GPU can JIT it; without nvcc, NVRTC's SASS alone (pip install
    'goinfer[cuda-build]')."""
    from tvm.support import nvcc

    arch = str(target.attrs["arch"]).removeprefix("sm_")
    with target:
        if cuda_compiler_name() == "nvcc":
            gencode = ["-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
            return bytes(nvcc.compile_cuda(source, target_format="fatbin", arch=gencode, compiler="nvcc"))
        return bytes(nvcc.compile_cuda(source, target_format="cubin", arch=f"sm_{arch}", compiler="nvrtc"))


# -- CPU ISA tiers --------------------------------------------------------------------------------
# A bundle carries its model compiled for the host's best tier and for the next tier below it
# (AVX2, or on an AVX2 host the generic x86-64-v2 forms), so a runtime whose self-test finds the
# best tier's kernels wrong can step down instead of returning wrong numbers.
TIER_ORDER = ("avx512-vnni", "avx512", "avx2", "sse")


FALLBACK_TIERS = (("avx2", "haswell"), ("sse", "x86-64-v2"))


def host_tier_name() -> str:
    """The best x86 feature level the host's LLVM CPU has, as a short tier name."""
    feats = codegen.llvm_get_cpu_features(make_target(host_target(1)))
    if "avx512vnni" in feats:
        return "avx512-vnni"
    if "avx512f" in feats:
        return "avx512"
    return "avx2" if "avx2" in feats else "sse"


def cpu_tiers(num_cores: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(tier name, target) from the best tier down; the first is the host's own ISA."""
    host = host_target(num_cores)
    best = host_tier_name()
    below = [(n, mcpu) for n, mcpu in FALLBACK_TIERS if TIER_ORDER.index(n) > TIER_ORDER.index(best)]
    return [(best, host), *((n, {**host, "mcpu": mcpu}) for n, mcpu in below[:1])]


def nontemporal_prefetch_pays(target: Target) -> bool:
    """Whether decode's read-once weight stream should be prefetched non-temporal on `target`.

    AMD Zen: yes. Decode 3-6% faster a token (Zen 3, AVX2: the stream stops evicting the step's
    code and data). Intel: no. The decode GEMVs read 12-17 GB/s with it against 25-29 GB/s with
    the ordinary prefetch (2-core Xeon with AVX-512 VNNI, int4 and int8int8, every model shape;
    26-30 GB/s plain read), likely as its prefetchnta fills L1 only, out of the L2 streamer's sight.
    """
    return str(target.attrs.get("mcpu", "")).startswith("znver")
