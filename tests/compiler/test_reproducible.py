"""Builds are reproducible: one checkpoint built twice with the same options, each time from an
empty cache in a fresh process (so nothing compiled or exported is shared), gives the same bytes.

TVM 0.27's VMShapeLower orders its shape computations by a hash of symbolic vars' addresses, so
without passes.order_shape_funcs each process emitted them in its own order (and merged different
ones); TVM's tar for Metal's objects carries the build's time and owner (export._reproducible_tar).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

# The second build first makes some objects and keeps them: its TVM objects then lie at other
# addresses than the first's, as they do from one machine or run to the next (ASLR alone often
# leaves an address-ordered hash map iterating the same way in two runs of one script).
_BUILD = """
import sys
from tvm import tirx
ballast = [tirx.Var(f"v{i}", "int64") for i in range(int(sys.argv[3]))]
from goinfer.compiler.build import BuildOptions, build
result = build(sys.argv[1], sys.argv[2], BuildOptions(quant="f32", num_cores=2, kv_dtype="float32"),
               progress=lambda _m: None)
print("from cache" if result.compiled_from_cache else "compiled")
"""


def _build_in_fresh_process(source: Path, out: Path, cache_root: Path, ballast: int) -> None:
    env = {**os.environ, "GOINFER_CACHE": str(cache_root), "TVM_USE_RUNTIME_LIB": "0"}
    run = subprocess.run(
        [sys.executable, "-c", _BUILD, str(source), str(out), str(ballast)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["compiled"], run.stdout  # from scratch, not from a cache


def _first_difference(a: Path, b: Path) -> str:
    """Which blob of two bundles differs first: a module, a tensor, or the manifest."""
    from goinfer.artifacts.giw import open_bundle

    x, y = open_bundle(a), open_bundle(b)
    if x.module_keys() != y.module_keys():
        return f"module lists differ: {x.module_keys()} vs {y.module_keys()}"
    for key in x.module_keys():
        if bytes(x.module_bytes(key)) != bytes(y.module_bytes(key)):
            return f"module {key!r} differs"
    if x.tensor_names() != y.tensor_names():
        return "tensor lists differ"
    for name in x.tensor_names():
        if x.tensor(name).tobytes() != y.tensor(name).tobytes():
            return f"tensor {name!r} differs"
    if x.manifest != y.manifest:
        fields = sorted(k for k in {*x.manifest, *y.manifest} if x.manifest.get(k) != y.manifest.get(k))
        return f"manifest differs in {fields}"
    return "no blob differs: the layout or padding does"


def test_two_cold_builds_in_two_processes_give_identical_bundles(tiny_gguf, tmp_path: Path) -> None:
    source = tiny_gguf("qwen2")
    a, b = tmp_path / "a.giw", tmp_path / "b.giw"
    _build_in_fresh_process(source, a, tmp_path / "cache-a", ballast=0)
    _build_in_fresh_process(source, b, tmp_path / "cache-b", ballast=1001)
    if a.read_bytes() != b.read_bytes():
        pytest.fail(f"two builds of one checkpoint differ: {_first_difference(a, b)}")


def test_a_module_lowered_many_times_gets_the_same_shape_func() -> None:
    """One Relax module parsed afresh 8 times (new symbolic vars, at new addresses) and lowered:
    VMShapeLower's 12 stores come out in some other order nearly every time; ours in one."""
    import tvm
    from goinfer.compiler.tvm import passes
    from tvm import relax, tirx
    from tvm.script import ir as I
    from tvm.script import relax as R

    def parse() -> tvm.IRModule:
        @I.ir_module
        class Concats:
            @R.function
            def main(x: R.Tensor(("n",), "float32")):
                a = R.concat((x, x))
                b = R.concat((x, x, x))
                c = R.concat((x, x, x, x))
                d = R.concat((x, x, x, x, x))
                e = R.concat((x, x, x, x, x, x))
                f = R.concat((x, x, x, x, x, x, x))
                return (a, b, c, d, e, f)

        return Concats

    lowering = [
        relax.transform.LegalizeOps(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        relax.transform.LowerAllocTensor(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
    ]
    theirs, ours, ballast = set(), set(), []
    for i in range(8):
        ballast.append([tirx.Var("b", "int64") for _ in range(37 * i + 1)])  # move the next objects
        lowered = tvm.transform.Sequential(lowering)(parse())
        theirs.add(lowered["shape_func"].script())
        ours.add(passes.order_shape_funcs()(lowered)["shape_func"].script())
    assert len(ours) == 1, ours
    # If this fails, a TVM upgrade made VMShapeLower deterministic and order_shape_funcs can go.
    assert len(theirs) > 1


def test_shape_funcs_are_sorted_merged_and_named_by_first_call() -> None:
    """shape_func2 (called first) and shape_func are one function once sorted: it becomes
    shape_func, the other one shape_func1, whatever order and names VMShapeLower gave them."""
    import tvm_ffi
    from goinfer.compiler.tvm import passes
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script import tirx as T

    # fmt: off
    @I.ir_module
    class Lowered:
        @T.prim_func(private=True)
        def shape_func(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]
            H[T.int64(1)] = T.int64(4) * H[T.int64(0)]

        @T.prim_func(private=True)
        def shape_func1(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(1)] = T.int64(8) * H[T.int64(0)]
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]

        @T.prim_func(private=True)
        def shape_func2(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(1)] = T.int64(4) * H[T.int64(0)]
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]

        @R.function(pure=False)
        def main(h: R.Tensor((3,), "int64")) -> R.Tensor((3,), "int64"):
            cls = Lowered
            cls.shape_func2(h)
            cls.shape_func1(h)
            cls.shape_func(h)
            return h

    @I.ir_module
    class Canonical:
        @T.prim_func(private=True)
        def shape_func(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(1)] = T.int64(4) * H[T.int64(0)]
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]

        @T.prim_func(private=True)
        def shape_func1(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(1)] = T.int64(8) * H[T.int64(0)]
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]

        @R.function(pure=False)
        def main(h: R.Tensor((3,), "int64")) -> R.Tensor((3,), "int64"):
            cls = Canonical
            cls.shape_func(h)
            cls.shape_func1(h)
            cls.shape_func(h)
            return h
    # fmt: on

    got = passes.order_shape_funcs()(Lowered)
    assert tvm_ffi.structural_equal(got, Canonical), got.script()


def test_a_shape_func_whose_stores_depend_on_each_other_keeps_its_order() -> None:
    import tvm_ffi
    from goinfer.compiler.tvm import passes
    from tvm.script import ir as I
    from tvm.script import tirx as T

    @I.ir_module
    class Chained:
        @T.prim_func(private=True)
        def shape_func(H: T.Buffer((T.int64(3),), "int64")):
            T.func_attr({"tirx.is_host_func": True})
            H[T.int64(2)] = T.int64(2) * H[T.int64(0)]
            H[T.int64(1)] = T.int64(4) * H[T.int64(2)]

    assert tvm_ffi.structural_equal(passes.order_shape_funcs()(Chained), Chained)


def test_metal_objects_tar_holds_no_time_owner_or_directory_order(tmp_path: Path) -> None:
    from goinfer.compiler.tvm import export

    (tmp_path / "lib0.o").write_bytes(b"host code")
    (tmp_path / "devc.o").write_bytes(b"kernels")
    files = [str(tmp_path / "lib0.o"), str(tmp_path / "devc.o")]
    export._reproducible_tar(str(tmp_path / "one.tar"), files)
    os.utime(tmp_path / "lib0.o", (time.time() + 1000, time.time() + 1000))
    export._reproducible_tar(str(tmp_path / "two.tar"), files[::-1])
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()
    with tarfile.open(tmp_path / "one.tar") as tar:
        assert [(m.name, m.mtime, m.uid, m.uname) for m in tar.getmembers()] == [
            ("devc.o", 0, 0, ""),
            ("lib0.o", 0, 0, ""),
        ]
        assert tar.extractfile("lib0.o").read() == b"host code"
