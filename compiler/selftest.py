"""Build-time half of the startup self-test: small fixed kernel fixtures, compiled per CPU tier.

Each fixture is one of our dispatched kernels (int4's and int8int8's GEMV and GEMM with their
run-time activation quantizers, int8, f32 and the encoders' f32 GEMM, and the grouped affine
kernel in every layout the bundle's weights use) on a tiny fixed input, with the answer its
portable numpy twin gives.
A kernel with an ISA-specific form (the VNNI and AVX2 ones) is compiled in the form each tier's
model gets. The runtime (runtime/selftest.py) runs every tier's library on them before trusting
that tier with a model: a wrong kernel on some CPU returns slightly wrong numbers rather than
crashing, and this is how it gets caught.

The libraries are cached beside the model's modules, keyed by the fixtures (their layouts), the
target, TVM and the source of the kernels and of this module: a rebuild neither builds a kernel
(`cases` gives each as a builder, called only for a compile) nor compiles one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from goinfer.artifacts.manifest import SelfTest, SelfTestCase
from tvm import te, tirx

from .fingerprint import selftest_fingerprint
from .kernels import affine as affine_tir
from .kernels import f32 as f32_tir
from .quant import affine, f32, int4, int8, int8int8
from .quant.scheme import Scheme
from .tvm import export, targets

# 37 rows: not a multiple of the 16-row block (exercises the clamped tails and padded rows); 256
# columns: 8 int4 groups. 1 token: the decode path; 6 and 40 tokens: the prefill tiles with and
# without a clamped last tile (int4: 4-token tiles; int8int8: 6-token tiles, a 4-token tail).
OUT, IN = 37, 256
TOLERANCE = 1e-5  # max |got - want| / max |want|; the kernels measure ~5e-7 on every tier here


def _te_kernel(scheme: Scheme, m: int) -> tirx.PrimFunc:
    x = te.placeholder((m, IN), "float32", name="x")
    params = [
        te.placeholder(shape, dtype, name=n) for n, (shape, dtype) in scheme.param_specs(OUT, IN).items()
    ]
    y = scheme.matmul(OUT, IN)(x, *params)
    return te.create_prim_func([x, *params, y])


Kernel = Callable[[], tirx.PrimFunc]  # builds a fixture's kernel (TVMScript parsing: seconds)
Case = tuple[Kernel, list[np.ndarray], np.ndarray]  # (its kernel, inputs, expected output)


def cases(seed: int = 0, layouts: tuple[affine_tir.Layout, ...] = ()) -> dict[str, Case]:
    """name -> (kernel builder, inputs, expected output); `layouts`: the grouped affine ones to
    add. The arrays are cheap; a kernel is built only where its library must be compiled."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    x40 = rng.standard_normal((40, IN)).astype(np.float32)
    x6 = x40[:6]
    out: dict[str, Case] = {}

    p4 = int4.pack(w)
    for m in (1, 6, 40):
        x = x40[:m]
        inputs = [x, p4["weight"], p4["scale"]]
        out[f"int4_m{m}"] = (partial(int4.matmul, OUT, IN), inputs, int4.reference(*inputs, OUT))

    p8 = int8.pack(w)
    w8 = p8["weight"].astype(np.float64) * p8["scale"][:, None]
    out["int8_m6"] = (
        partial(_te_kernel, int8, 6),
        [x6, p8["weight"], p8["scale"]],
        (x6 @ w8.T).astype(np.float32),
    )

    p88 = int8int8.pack(w)
    for m in (1, 6, 40):
        x = x40[:m]
        inputs = [x, p88["weight"], p88["wsum"], p88["scale"]]
        out[f"int8int8_m{m}"] = (partial(int8int8.matmul, OUT, IN), inputs, int8int8.reference(*inputs))

    for layout in layouts:
        p = affine.example(layout, OUT, IN, seed)
        for m in (1, 6):
            x = x40[:m]
            want = affine.reference(layout, x, p, OUT)
            out[f"affine_{layout.tag.replace('-', '_')}_m{m}"] = (
                partial(affine_tir.kernel, OUT, IN, layout),
                [x, *p.values()],
                want,
            )

    out["f32_m6"] = (
        partial(_te_kernel, f32, 6),
        [x6, f32.pack(w)["weight"]],
        (x6 @ w.T.astype(np.float64)).astype(np.float32),
    )
    # the encoders' register-tiled GEMM (40 tokens: a clamped last token tile; 37 rows: a clamped
    # last row tile)
    out["f32_gemm_m40"] = (
        partial(f32_tir.gemm, OUT, IN),
        [x40, f32.pack(w)["weight"]],
        (x40 @ w.T.astype(np.float64)).astype(np.float32),
    )
    return out


def fixtures(
    seed: int = 0, layouts: tuple[affine_tir.Layout, ...] = ()
) -> dict[str, tuple[tirx.PrimFunc, list[np.ndarray], np.ndarray]]:
    """name -> (kernel, inputs, expected output): `cases` with every kernel built."""
    return {name: (kernel(), inputs, want) for name, (kernel, inputs, want) in cases(seed, layouts).items()}


def tensors_and_manifest(
    fx: dict[str, tuple[Any, list[np.ndarray], np.ndarray]],
) -> tuple[list[tuple[str, np.ndarray]], SelfTest]:
    """Bundle tensors for the fixtures' (or cases') inputs and answers, and the manifest entry
    naming them."""
    tensors: list[tuple[str, np.ndarray]] = []
    entries = []
    for name, (_f, inputs, want) in fx.items():
        names = tuple(f"selftest.{name}.in{i}" for i in range(len(inputs)))
        tensors += list(zip(names, inputs, strict=True))
        tensors.append((f"selftest.{name}.want", want))
        entries.append(SelfTestCase(kernel=name, inputs=names, want=f"selftest.{name}.want"))
    return tensors, SelfTest(tolerance=TOLERANCE, cases=tuple(entries))


def kernels(fx: dict[str, tuple[Any, list[np.ndarray], np.ndarray]]) -> dict[str, tirx.PrimFunc]:
    """Each fixture's (or case's) kernel, built where it is a builder."""
    return {name: f if isinstance(f, tirx.PrimFunc) else f() for name, (f, _i, _w) in fx.items()}


def compile_for(fx: dict[str, tuple[Any, list[np.ndarray], np.ndarray]], target: dict) -> bytes:
    """The fixtures' (or cases') kernels compiled for one tier's target, as shared-library bytes."""
    return compile_kernels(kernels(fx), target)


def compile_kernels(funcs: dict[str, tirx.PrimFunc], target: dict) -> bytes:
    """Built kernels compiled for one tier's target (several targets may compile at once, on
    threads), as shared-library bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "selftest.so"
        export.compile_kernels(funcs, target, str(path))
        return path.read_bytes()


# -- the compiled libraries, cached as the model's modules are --------------------------------------


def cache_key(layouts: tuple[affine_tir.Layout, ...], target: dict, seed: int = 0) -> str:
    """What a self-test library depends on: the fixtures (their layouts and seed), the target, TVM,
    and the source of the kernels and of this module."""
    key_src = {
        "layouts": [repr(layout) for layout in layouts],
        "seed": seed,
        "shape": [OUT, IN],
        "target": target,
        "tvm": targets.TVM_VERSION,
        "code": selftest_fingerprint(),
    }
    return "selftest-" + hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:32]


def _cached_path(layouts: tuple[affine_tir.Layout, ...], target: dict, seed: int) -> Path:
    from . import compile_cache

    return compile_cache.cache_dir() / cache_key(layouts, target, seed) / "selftest.so"


def cached_library(layouts: tuple[affine_tir.Layout, ...], target: dict, seed: int = 0) -> bytes | None:
    """The library compiled before for these fixtures and target, or None."""
    path = _cached_path(layouts, target, seed)
    try:
        return path.read_bytes()
    except OSError:
        return None


def store_library(layouts: tuple[affine_tir.Layout, ...], target: dict, lib: bytes, seed: int = 0) -> None:
    """Keep a compiled library for the next build (atomically: a crash leaves none half-written)."""
    path = _cached_path(layouts, target, seed)
    with contextlib.suppress(OSError):  # an unwritable cache only costs a compile next time
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".selftest.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(lib)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
