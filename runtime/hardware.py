"""The block a hardware bug report needs (`goinfer check --hardware`): build, OS, CPU, ISA tiers,
memory, GPU, backends and self-test results. It names no host, user, home directory or address."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# The CPU flags our kernels care about, as /proc/cpuinfo spells them.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
)


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def _meminfo_gib(key: str) -> float | None:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) / 2**20 if m else None


def facts() -> dict[str, Any]:
    from goinfer.runtime import cuda, selftest, threads

    gpu = cuda.probe()
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "goinfer": _version(),
        "tvm": _version("apache-tvm"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "cpu": info.get("model name") or platform.processor() or "unknown",
        "threads": os.cpu_count(),
        "kernel_threads": threads.configure(),
        "isa": {f: f in flags for f in ISA_FLAGS},
        "memory_gib": {"total": _meminfo_gib("MemTotal"), "available": _meminfo_gib("MemAvailable")},
        "backends": {
            "llvm (CPU)": "linked",
            "cuda": "usable" if gpu.usable else f"unavailable: {gpu.reason}",
            "metal": "not run by this runtime (--target metal emits bundles for macOS)",
        },
        "gpu": gpu.to_json(),
        "selftest": [r.to_json() for r in selftest.RESULTS],
    }


def _version(package: str = "goinfer") -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _gpu_lines(gpu: dict[str, Any] | None) -> list[str]:
    """One line per usable device, else one saying why none is."""
    if gpu is None:
        return []
    if not gpu["usable"]:
        return [f"gpu       none usable ({gpu['reason']})"]
    versions = f"driver {gpu['driver_version']}, runtime {gpu['runtime_version']}"
    return [
        f"gpu       cuda:{d['index']} {d['name']}, {d['arch']}, {d['total_memory'] / 2**30:.1f} GiB, "
        + versions
        for d in gpu["devices"]
    ]


def render(f: dict[str, Any], tiers: list[tuple[str, str]]) -> str:
    """`tiers`: (tier, "in use" | "available" | "stepped down" | ...) from best to lowest."""
    mem = f["memory_gib"]
    lines = [
        f"goinfer   {f['goinfer']}  (TVM {f['tvm']}, Python {f['python']})",
        f"os        {f['os']}",
        f"cpu       {f['cpu']}, {f['threads']} threads (kernels run on {f['kernel_threads']})",
        "isa       " + " ".join(f"{k}{'+' if v else '-'}" for k, v in f["isa"].items()),
        "          (AMX is switched off in every build: its instructions fault on these VMs)",
        "tiers     " + ", ".join(f"{t} ({state})" for t, state in tiers),
        f"memory    {mem['total']:.1f} GiB total, {mem['available']:.1f} GiB available"
        if mem["total"] is not None
        else "memory    unknown",
        *_gpu_lines(f.get("gpu")),
        "backends  " + ", ".join(f"{k}: {v}" for k, v in f["backends"].items()),
    ]
    for r in f["selftest"] or [{"status": "not run"}]:
        detail = f"{r['status']}, tier {r.get('tier') or '-'}, {r.get('elapsed_ms', 0):.1f} ms"
        if r.get("stepped_down"):
            detail += f", stepped down from {', '.join(r['stepped_down'])}"
        for m in r.get("mismatches", []):
            detail += f"; {m['kernel']}@{m['tier']} {m['observed']:.3g} > {m['allowed']:.0e}"
        if r.get("reason"):
            detail += f" ({r['reason']})"
        lines.append(f"selftest  {detail}")
    return "\n".join(lines)
