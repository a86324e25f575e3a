"""Bundles with a CUDA module, on machines without a GPU (CI and every session here).

What can be checked without a device: the build (both targets in one bundle, the arch shown,
byte-reproducible, the kernels compiled ahead of time), the GPU self-test's fixture (the CPU
module's logits), which module `--device` picks and the one-line errors when it cannot, and the
load path up to device allocation against a stand-in driver (tests/runtime/cuda_driver_double.py).
The GPU itself is tests/gpu/run.sh's, on a lent device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cuda_driver_double import build as build_driver_double
from goinfer.artifacts import giw, manifest
from goinfer.compiler.build import BuildOptions, build
from goinfer.runtime import cuda

pytestmark = pytest.mark.skipif(
    __import__("goinfer.compiler.tvm.targets", fromlist=["x"]).cuda_compiler_name() is None,
    reason="no CUDA compiler here (nvcc, or pip install 'goinfer[cuda-build]')",
)
OPTIONS = BuildOptions(target="llvm,cuda", quant="int4", num_cores=2, kv_dtype="float32")


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def both(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda") / "tiny-llama.int4.llvm+cuda.giw"
    build(tiny_gguf("llama"), out, OPTIONS, progress=_quiet)
    return out


@pytest.fixture(scope="module")
def cuda_only(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda") / "tiny-llama.int4.cuda.giw"
    build(
        tiny_gguf("llama"),
        out,
        BuildOptions(target="cuda", quant="int4", num_cores=2, kv_dtype="float32"),
        _quiet,
    )
    return out


def test_one_bundle_holds_both_targets_and_names_the_arch(both) -> None:
    with giw.open_bundle(both) as b:
        m = manifest.Manifest.of(b)
        (gpu,) = m.gpu_modules
        assert (gpu.kind, gpu.arch, m.build.target) == ("cuda", "sm_90", "llvm,cuda")
        assert m.cpu_tiers[0].module == "llvm"
        kernels = bytes(b.module_bytes(gpu.kernels))
        assert len(kernels) > 1000 and len(gpu.kernels_source_sha256) == 64
        text = manifest.describe(b)
    assert "module   cuda  cuda sm_90" in text
    assert "module   cuda.kernels  cuda sm_90" in text


def test_cuda_build_is_byte_reproducible(tiny_gguf, tmp_path, monkeypatch) -> None:
    """A rebuild writes the same bytes (the compiled modules reused), and the CUDA kernels, which
    nvcc compiles, come out the same from two cold compiles. (Cold builds' host code can still
    differ in a few bytes of instruction order: TVM's LLVM codegen, for the CPU modules too.)"""
    options = BuildOptions(target="cuda", quant="int4", num_cores=2, kv_dtype="float32")
    kernels, shas = [], []
    for i in range(2):
        monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / f"cache{i}"))
        out = tmp_path / f"b{i}.giw"
        build(tiny_gguf("llama"), out, options, progress=_quiet)
        shas.append(build(tiny_gguf("llama"), out, options, progress=_quiet).sha256)
        assert build(tiny_gguf("llama"), out, options, progress=_quiet).sha256 == shas[-1]
        with giw.open_bundle(out) as b:
            kernels.append(b.module_info("cuda.kernels").sha256)
    assert kernels[0] == kernels[1]


def test_gpu_selftest_fixture_is_the_cpu_modules_logits(both) -> None:
    from goinfer.runtime.model import Model

    m = Model.load(both, device="cpu")
    test = m.manifest.gpu_selftest
    ids = [int(t) for t in m.bundle.tensor(test.prompt)]
    want = np.asarray(m.bundle.tensor(test.want))
    got = np.concatenate(list(m.prefill_logits(ids)))
    assert want.shape == (len(ids), m.spec.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert test.min_cosine == 0.995


def test_device_choice_without_a_gpu(both, cuda_only, capsys) -> None:
    if cuda.probe().usable:
        pytest.skip("this machine has a usable GPU")
    from goinfer.runtime.devices import DeviceError
    from goinfer.runtime.model import Model

    m = Model.load(both)  # auto: the CPU module, with one line saying why
    assert m.device == "cpu" and m.tier
    err = capsys.readouterr().err
    assert "running on the CPU: CUDA is unusable here (no NVIDIA driver" in err
    assert len([line for line in err.splitlines() if "running on the CPU" in line]) == 1
    with pytest.raises(DeviceError, match="needs CUDA, which is unusable here: no NVIDIA driver"):
        Model.load(both, device="cuda")
    with pytest.raises(DeviceError, match=r"needs CUDA \(it has no CPU module\)"):
        Model.load(cuda_only)
    with pytest.raises(
        DeviceError, match=r"has no CPU module \(built for cuda\); rebuild it with --target llvm,cuda"
    ):
        Model.load(cuda_only, device="cpu")


def test_cli_cuda_only_bundle_without_a_gpu_is_one_line_exit_2(cuda_only) -> None:
    if cuda.probe().usable:
        pytest.skip("this machine has a usable GPU")
    goinfer = Path(sys.executable).with_name("goinfer")
    r = subprocess.run([str(goinfer), "generate", str(cuda_only), "hi"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("goinfer: error: bundle ")


_LOAD = textwrap.dedent(
    """
    import json, sys
    from goinfer.runtime import cuda
    from goinfer.runtime.model import Model

    served = []
    prebuilt = cuda.serve_prebuilt_kernels
    cuda.serve_prebuilt_kernels = lambda k: (served.append(sorted(k)), prebuilt(k))[1]
    out = {}
    for device in ("auto", "cuda"):
        try:
            m = Model.load(sys.argv[1], device=device)
            out[device] = m.device
        except ValueError as e:
            out[device] = type(e).__name__ + ": " + str(e)
    out["served"] = served
    print(json.dumps(out))
    """
)


def test_load_path_runs_to_device_allocation_on_a_driver_test_double(both, tmp_path) -> None:
    """A stand-in libcuda.so.1 (a test double: it reports one sm_90 device and refuses real
    work): the driver and TVM's CUDA runtime load, the module loads with the kernels compiled at
    build (no compiler at load), and the first device allocation fails. auto then runs on the CPU
    with one line; --device cuda is a one-line error."""
    driver = build_driver_double(tmp_path)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{driver.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([sys.executable, "-c", _LOAD, str(both)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    with giw.open_bundle(both) as b:
        sha = manifest.Manifest.of(b).gpu_modules[0].kernels_source_sha256
    assert out["served"] == [[sha], [sha]]
    assert out["auto"] == "cpu"
    assert (
        out["cuda"].startswith("DeviceError: bundle ")
        and "cannot start the sm_90 module on cuda:0" in out["cuda"]
    )
    assert "\n" not in out["cuda"]
    line = [x for x in r.stderr.splitlines() if "running on the CPU" in x]
    assert len(line) == 1 and "CUDA: cannot start the sm_90 module on cuda:0" in line[0]
