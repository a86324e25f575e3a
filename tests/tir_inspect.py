"""Reading kernels' TIR in tests: what a kernel asks of the hardware, beyond what it computes."""

from __future__ import annotations

import tvm
import tvm_ffi


def prefetch_localities(func: tvm.tirx.PrimFunc) -> tuple[set[int], set[int]]:
    """The locality hints (3: keep in every cache level, 0: non-temporal) of the software
    prefetches under the kernel's `m == 1` (decode) branch, and of those elsewhere."""

    def hints(stmt) -> set[int]:
        found: set[int] = set()

        def visit(node: tvm.ir.Call) -> None:
            if node.op.name == "tirx.call_llvm_intrin":
                found.add(int(node.args[3]))  # (intrinsic, address, rw, locality, cache)

        tvm_ffi.structural_walk(stmt, [(tvm.ir.Call, visit)], order="post")
        return found

    branches: list[tvm.tirx.IfThenElse] = []

    def find(node: tvm.tirx.IfThenElse) -> None:
        c = node.condition
        if isinstance(c, tvm.tirx.EQ) and isinstance(c.b, tvm.tirx.IntImm) and c.b.value == 1:
            branches.append(node)

    tvm_ffi.structural_walk(func.body, [(tvm.tirx.IfThenElse, find)], order="post")
    assert len(branches) == 1, "expected one m == 1 branch"
    return hints(branches[0].then_case), hints(branches[0].else_case)
