"""No hand-written kernel keeps a scalar in a `local` buffer.

In TVM 0.27's TVMScript, `x = expr` inside a kernel declares a one-element buffer of scope
`local`, not a value. Inside a parallel loop, each one is a TVMBackendAllocWorkspace and a free per
iteration, and every use a load: the decode attention kernel made 12 such calls per task (SmolLM2,
64 keys: 10 -> 5 us a layer without them). Kernels bind values with `T.Bind` (or T.meta_var for
Python tuples) instead.
"""

from __future__ import annotations

import pytest
import tvm
from goinfer.compiler.kernels import affine, attention, gated, int8int8, kv_append
from goinfer.compiler.quant import int4


def _children(node):
    for name in ("body", "seq", "then_case", "else_case"):
        value = getattr(node, name, None)
        if isinstance(value, tvm.tirx.Stmt):
            yield value
        elif value is not None and not isinstance(value, tvm.tirx.Stmt | tvm.ir.Node):
            yield from (v for v in value if isinstance(v, tvm.tirx.Stmt))


def local_scalars_in_parallel_loops(stmt, parallel: bool = False) -> list[str]:
    """Names of `local` buffers allocated inside a parallel loop, anywhere under stmt."""
    found = []
    if isinstance(stmt, tvm.tirx.AllocBuffer) and parallel and stmt.buffer.scope() == "local":
        found.append(stmt.buffer.name)
    inside = parallel or (isinstance(stmt, tvm.tirx.For) and stmt.kind == tvm.tirx.ForKind.PARALLEL)
    for child in _children(stmt):
        found += local_scalars_in_parallel_loops(child, inside)
    return found


KERNELS = {
    "decode": lambda: attention.decode(2, 6, 32, sliding=False, window=0),
    "decode_sliding": lambda: attention.decode(2, 6, 32, sliding=True, window=64),
    "decode_one_kv_head": lambda: attention.decode(1, 4, 32, sliding=False, window=0),
    "prefill": lambda: attention.prefill(2, 6, 32, sliding=False, window=0),
    "prefill_sliding": lambda: attention.prefill(2, 6, 32, sliding=True, window=64),
    "gated_silu": lambda: gated.kernel(96, "silu"),
    "kv_append": lambda: kv_append.transpose_append(2, 32),
    "kv_split": lambda: kv_append.split_qkv(6, 2, 32),
    **{f"int4_{f}": (lambda f=f: affine.kernel_variant(64, 128, int4.LAYOUT, f)) for f in affine.FORMS},
    # the GGUF transcode's widest layouts: K-quant codes with a min, groups of 16, 5 bits
    **{
        f"gguf_{tag}_{f}": (lambda f=f, lay=lay: affine.kernel_variant(64, 256, lay, f))
        for tag, lay in (
            ("q4k", affine.Layout(4, 32, "int8", True, 0)),
            ("q6k_q4k", affine.Layout(6, 16, "int8", True, 32)),
            ("q5_0", affine.Layout(5, 32, "float16", False, 16)),
        )
        for f in affine.FORMS
    },
    **{f"int8int8_{f}": (lambda f=f: int8int8.kernel_variant(64, 128, f)) for f in int8int8.FORMS},
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_binds_values_instead_of_local_scalars(name):
    assert local_scalars_in_parallel_loops(KERNELS[name]().body) == []


def test_the_check_sees_a_local_scalar():
    from tvm.script import tirx as T

    @T.prim_func
    def kernel(a: T.Buffer((8,), "int32")):
        for i in T.parallel(8):
            j = i // 2
            a[i] = j

    assert local_scalars_in_parallel_loops(kernel.body) == ["j"]
