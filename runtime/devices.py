"""Which of a bundle's modules runs here: `--device auto|cpu|cuda` against what the bundle holds
and what this machine can do.

auto takes a bundle's CUDA module when the driver and TVM's CUDA runtime load and a GPU answers,
and its CPU module otherwise, saying why in one line. Asking for a device the bundle was not built
for, or one this machine lacks, is a DeviceError whose message says what to do.
"""

from __future__ import annotations

from collections.abc import Callable

from goinfer.artifacts.manifest import Manifest

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """The bundle cannot run on the device asked for (or on any device here); one line."""


def choose(m: Manifest, want: str, name: str, say: Callable[[str], None]) -> str:
    """ "cpu" or "cuda": where bundle `name` runs for `--device want`."""
    if want not in DEVICES:
        raise DeviceError(f"unknown device {want!r}; choose one of {', '.join(DEVICES)}")
    has_cpu = bool(m.cpu_tiers)
    has_cuda = any(g.kind == "cuda" for g in m.gpu_modules)
    built = m.build.target
    if want == "cpu" or (want == "auto" and not has_cuda):
        if not has_cpu:
            metal = " (Metal modules are emitted for macOS but not run yet)" if "metal" in built else ""
            raise DeviceError(
                f"bundle {name} has no CPU module (built for {built}){metal}; "
                f"rebuild it with --target llvm,{built}"
            )
        return "cpu"
    if not has_cuda:
        raise DeviceError(
            f"bundle {name} has no CUDA module (built for {built}); rebuild it with --target {built},cuda"
        )
    arch = next(g.arch for g in m.gpu_modules if g.kind == "cuda")
    reason = _cuda_unusable(arch)
    if reason is None:
        return "cuda"
    if want == "cuda" or not has_cpu:
        only = "" if want == "cuda" else " (it has no CPU module)"
        raise DeviceError(f"bundle {name} needs CUDA{only}, which is unusable here: {reason}")
    say(f"goinfer: {name}: running on the CPU: CUDA is unusable here ({reason})")
    return "cpu"


def _cuda_unusable(arch: str) -> str | None:
    """Why a module compiled for `arch` ("sm_90") cannot run here, or None when it can (TVM's CUDA
    runtime is then loaded). Its SASS and PTX run on that compute capability or a newer one."""
    from . import cuda

    p = cuda.probe()
    if not p.usable:
        return p.reason
    have, need = p.devices[0].compute_capability, _capability(arch)
    if have < need:
        return f"the GPU ({p.devices[0].name}) is {p.arch()}, older than the bundle's {arch}"
    try:
        cuda.enable()
    except cuda.CudaUnavailable as e:
        return str(e)
    return None


def _capability(arch: str) -> tuple[int, int]:
    digits = arch.removeprefix("sm_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])
