"""The runtime's CUDA door on machines without a GPU: no driver at all, and a driver test double.

Each scenario runs in a fresh interpreter: the libraries a process loads (libcudart, TVM's CUDA
runtime, the driver) stay loaded, so one test's state must not decide another's.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cuda_driver_double import NAME, TOTAL_MEMORY, build
from goinfer.runtime import cuda, hardware

_SCENARIO = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from goinfer.runtime import cuda, hardware

    out = {"probe": cuda.probe().to_json()}
    try:
        cuda.enable()
        out["enable"] = "ok"
        import tvm_ffi
        out["device_api"] = tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None
    except cuda.CudaUnavailable as e:
        out["enable"] = "CudaUnavailable: " + str(e)
    try:
        cuda.upload(np.zeros((1024, 1024), np.float32))
        out["upload"] = "ok"
    except (cuda.CudaError, cuda.CudaUnavailable) as e:
        out["upload"] = type(e).__name__ + ": " + str(e)
    f = hardware.facts()
    out["facts_cuda"] = f["backends"]["cuda"]
    out["facts_gpu"] = f["gpu"]
    out["render"] = hardware.render(f, [])
    out["tvm_imported"] = "tvm" in sys.modules
    print(json.dumps(out))
    """
)


def _run(env: dict[str, str]) -> dict:
    res = subprocess.run([sys.executable, "-c", _SCENARIO], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]  # a crash in a CUDA library shows up here
    return json.loads(res.stdout.strip().splitlines()[-1])


def _host_has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def no_driver() -> dict:
    if _host_has_driver():
        pytest.skip("this machine has an NVIDIA driver")
    return _run(dict(os.environ))


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> dict:
    stub_dir = build(tmp_path_factory.mktemp("cuda_driver_double")).parent
    # Searched before the system's directories, so the double also wins on a machine with a GPU.
    env = dict(
        os.environ, LD_LIBRARY_PATH=os.pathsep.join([str(stub_dir), os.environ.get("LD_LIBRARY_PATH", "")])
    )
    return _run(env)


def _one_line(text: str) -> bool:
    return bool(text) and "\n" not in text


# -- no driver (this machine) ---------------------------------------------------------------------


def test_probe_without_a_driver_names_libcuda(no_driver: dict) -> None:
    p = no_driver["probe"]
    assert p["usable"] is False and p["devices"] == [] and p["driver_version"] == ""
    assert p["reason"] == "no NVIDIA driver: libcuda.so.1 not found"


def test_enable_without_a_driver_is_one_line(no_driver: dict) -> None:
    assert no_driver["enable"] == "CudaUnavailable: no NVIDIA driver: libcuda.so.1 not found"
    assert no_driver["upload"] == no_driver["enable"]  # upload enables first
    assert not no_driver["tvm_imported"]


def test_hardware_report_without_a_driver(no_driver: dict) -> None:
    assert no_driver["facts_cuda"] == "unavailable: no NVIDIA driver: libcuda.so.1 not found"
    assert no_driver["facts_gpu"]["usable"] is False
    assert (
        "gpu       none usable (no NVIDIA driver: libcuda.so.1 not found)" in no_driver["render"].splitlines()
    )


# -- the driver test double -----------------------------------------------------------------------


def test_probe_reads_the_stand_in_driver(stand_in: dict) -> None:
    p = stand_in["probe"]
    assert p["usable"] is True and p["reason"] == "", p
    assert p["driver_version"] == "13.0" and p["runtime_version"].startswith("13.")
    assert p["devices"] == [
        {
            "index": 0,
            "name": NAME,
            "compute_capability": [9, 0],
            "arch": "sm_90",
            "total_memory": TOTAL_MEMORY,
        }
    ]


def test_enable_loads_tvm_cuda_runtime_over_the_stand_in(stand_in: dict) -> None:
    assert stand_in["enable"] == "ok" and stand_in["device_api"] is True
    assert not stand_in["tvm_imported"]


def test_upload_reaches_device_allocation(stand_in: dict) -> None:
    """The double refuses everything past the probe: the load path ran all the way to cudaMalloc,
    and its failure comes back as one line naming the device."""
    msg = stand_in["upload"]
    assert msg.startswith("CudaError: CUDA: cannot allocate 4.0 MiB on cuda:0: "), msg
    assert _one_line(msg)


def test_hardware_report_with_the_stand_in(stand_in: dict) -> None:
    assert stand_in["facts_cuda"] == "usable"
    runtime = stand_in["probe"]["runtime_version"]
    want = f"gpu       cuda:0 {NAME}, sm_90, 141.0 GiB, driver 13.0, runtime {runtime}"
    assert want in stand_in["render"].splitlines(), stand_in["render"]


# -- in process, no CUDA needed -------------------------------------------------------------------


def test_probe_arch_and_json() -> None:
    p = cuda.Probe(True, "", (cuda.GpuDevice(0, "x", (8, 6), 2**30),), "13.0", "13.5")
    assert p.arch() == "sm_86"
    json.dumps(p.to_json())


def test_download_of_a_host_tensor_is_a_copy() -> None:
    import tvm_ffi

    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = cuda.download(tvm_ffi.from_dlpack(src))
    assert np.array_equal(got, src) and not np.shares_memory(got, src)


def test_render_lists_each_usable_device() -> None:
    gpu = cuda.Probe(
        True, "", tuple(cuda.GpuDevice(i, "H100", (9, 0), 80 * 2**30) for i in range(2)), "13.0", "13.5"
    ).to_json()
    lines = hardware._gpu_lines(gpu)
    assert lines == [f"gpu       cuda:{i} H100, sm_90, 80.0 GiB, driver 13.0, runtime 13.5" for i in range(2)]


def test_double_builds_a_driver_library(tmp_path: Path) -> None:
    lib = build(tmp_path)
    assert lib.name == "libcuda.so.1" and (tmp_path / "libcuda.so").resolve() == lib.resolve()
