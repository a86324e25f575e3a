"""The kernels' thread count: one per physical core unless the user says otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from goinfer.runtime import threads


def _topology(root: Path, cpus: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_hyperthread_siblings_count_once(tmp_path):
    root = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert threads.physical_cores({0, 1, 2, 3}, root) == 2
    assert threads.physical_cores({0, 2}, root) == 1  # an affinity mask of one core's siblings


def test_cores_without_smt_all_count(tmp_path):
    root = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0)})
    assert threads.physical_cores({0, 1, 2}, root) == 3  # same core id on two packages: two cores


def test_unreadable_topology_falls_back_to_the_cpu_count(tmp_path):
    assert threads.physical_cores({0, 1, 5}, tmp_path) == 3


def test_user_setting_wins(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    assert threads.configure() == 3
    monkeypatch.delenv("TVM_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.configure() == 5


def test_default_is_set_before_tvm_reads_it(monkeypatch):
    """Loading the runtime sets TVM_NUM_THREADS, which TVM's pool reads when it first starts."""
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = (
        "import os; from goinfer.runtime import tvm_runtime, threads;"
        "assert os.environ['TVM_NUM_THREADS'] == str(threads.physical_cores()) == str(tvm_runtime.THREADS)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
