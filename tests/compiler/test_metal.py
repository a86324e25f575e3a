"""`--target metal` on Linux: TVM emits the Metal kernels as source inside Mach-O objects, to be
linked on the Mac that loads them. Nothing here runs them (no Mac); these check the emission."""

from __future__ import annotations

import io
import re
import tarfile

import pytest
from goinfer.artifacts import giw, manifest
from goinfer.compiler.build import BuildOptions, build

MACHO_64 = bytes.fromhex("cffaedfe")  # MH_MAGIC_64, little-endian


def test_vector_lanes_are_capped_at_four_for_metal() -> None:
    """Metal's vector types stop at 4 lanes: a float16x8 loop fails its codegen; capped, it emits."""
    import tvm
    from goinfer.compiler.tvm import passes, targets
    from tvm import s_tir, te, tirx

    a = te.placeholder((1024,), "float16", name="a")
    b = te.compute((1024,), lambda i: a[i] * tirx.const(2, "float16"), name="b")
    sch = s_tir.Schedule(te.create_prim_func([a, b]))
    (loop,) = sch.get_loops(sch.get_sblock("b"))
    block, thread, lane = sch.split(loop, [None, 32, 8])
    sch.bind(block, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    sch.vectorize(lane)
    target = targets.make_target(targets.metal_target())
    with target, pytest.raises(Exception, match="float16x8"):
        tvm.compile(sch.mod, target=target)
    with target:
        source = (
            tvm.compile(passes.cap_vector_lanes(sch.mod, 4), target=target).mod.imports[0].inspect_source()
        )
    assert "half4" in source and "half8" not in source


@pytest.fixture(scope="module")
def metal_bundle(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("metal") / "tiny.metal.giw"
    options = BuildOptions(target="metal", quant="int4", num_cores=2)
    build(tiny_gguf("llama"), out, options, progress=lambda _m: None)
    return out


def test_metal_bundle_holds_mach_o_objects_with_metal_source(metal_bundle) -> None:
    with giw.open_bundle(metal_bundle) as b:
        m = manifest.Manifest.of(b)
        (gpu,) = m.gpu_modules
        assert (gpu.kind, gpu.module, gpu.arch, m.cpu_tiers) == ("metal", "metal", "", ())
        with tarfile.open(fileobj=io.BytesIO(bytes(b.module_bytes("metal")))) as objects:
            blobs = {i.name: objects.extractfile(i).read() for i in objects.getmembers()}
    assert sorted(blobs) == ["devc.o", "lib0.o"]
    assert all(blob.startswith(MACHO_64) for blob in blobs.values())
    start = blobs["devc.o"].index(b"#include <metal_stdlib>")
    metal = blobs["devc.o"][start : blobs["devc.o"].index(b"\0", start)].decode()
    assert "kernel void" in metal
    # Metal's vectors stop at 4 lanes: no 8- or 16-lane vector type in the source
    assert not re.search(r"\b(half|float|int|uint|short|ushort|char|uchar|bool)(8|16)\b", metal)


def test_a_metal_only_bundle_is_refused_here_in_one_line(metal_bundle) -> None:
    from goinfer.runtime.devices import DeviceError
    from goinfer.runtime.model import Model

    with pytest.raises(
        DeviceError, match=r"has no CPU module \(built for metal\) \(Metal modules are emitted"
    ):
        Model.load(metal_bundle)
