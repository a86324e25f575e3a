"""How many threads the compiled kernels run on.

TVM's thread pool, left to itself, takes half the logical CPUs on x86 (it assumes every core has
two hyper-threads). On a VM without SMT that is half the cores: SmolLM2 decode ran at 14 ms a
token instead of 8 on a 2-core host (measured). Like llama.cpp, we default to one thread per
physical core this process may run on; TVM_NUM_THREADS (or OMP_NUM_THREADS) still wins.
"""

from __future__ import annotations

import os
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(cpus: set[int] | None = None, sys_cpu: Path = _SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus` (default: this process's affinity mask); the CPU
    count itself where the topology cannot be read."""
    if cpus is None:
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            cores.add((package, (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def configure() -> int:
    """Set the kernels' thread count before TVM's pool starts; returns the count in force."""
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    n = physical_cores()
    os.environ["TVM_NUM_THREADS"] = str(n)  # read by TVM's pool when it first starts
    return n
