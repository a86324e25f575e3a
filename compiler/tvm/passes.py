"""TIR intrinsics the kernels call, and the passes over compiled modules: ISA forms picked per
target, prefetches kept where they pay, vector lanes capped for Metal, and shape functions put in
a canonical order (reproducible builds). Written against TVM 0.27.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.target import Target, codegen

from . import targets


def cap_vector_lanes(mod: tvm.IRModule, lanes: int) -> tvm.IRModule:
    """Every vectorized loop longer than `lanes` split into a serial loop over `lanes`-wide ones
    (a schedule's 8-lane float16 loads become two 4-lane loads on Metal)."""

    def blocks_under(sch: s_tir.Schedule, parent):
        for block in sch.get_child_blocks(parent):
            yield block
            yield from blocks_under(sch, block)

    out = mod.clone()
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        try:
            root = sch.get_sblock("root")
        except Exception:  # no blocks: nothing a schedule vectorized
            continue
        changed = False
        for block in list(blocks_under(sch, root)):
            for loop in sch.get_loops(block):
                st = sch.get(loop)
                extent = st.extent
                if st.kind != tirx.ForKind.VECTORIZED or not isinstance(extent, tirx.IntImm):
                    continue
                if int(extent) > lanes and int(extent) % lanes == 0:
                    _outer, inner = sch.split(loop, [None, lanes])
                    sch.vectorize(inner)
                    changed = True
        if changed:
            out.update_func(gv, sch.mod["main"])
    return out


def _shape_func_stores(func: tirx.PrimFunc) -> list[tuple[int, tirx.BufferStore]] | None:
    """A VMShapeLower shape function's statements as (heap slot written, store), or None where the
    body is anything else or a store reads a slot another one writes (the order would matter)."""
    body = func.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    stores: list[tuple[int, tirx.BufferStore]] = []
    reads: set[int] = set()

    def note_read(load: tvm.ir.TensorLoad) -> tvm.ir.TensorLoad:
        index = load.indices[0] if len(load.indices) == 1 else None
        known = isinstance(index, tirx.IntImm) and load.source.same_as(heap)
        reads.add(int(index) if known else -1)  # -1: a read this check cannot place
        return load

    heap = stmts[0].buffer if isinstance(stmts[0], tirx.BufferStore) else None
    for stmt in stmts:
        if not isinstance(stmt, tirx.BufferStore) or len(stmt.indices) != 1:
            return None
        if not isinstance(stmt.indices[0], tirx.IntImm) or not stmt.buffer.same_as(heap):
            return None
        tvm_ffi.structural_map(stmt.value, [(tvm.ir.TensorLoad, note_read)])
        stores.append((int(stmt.indices[0]), stmt))
    written = {slot for slot, _ in stores}
    if -1 in reads or reads & written or len(written) != len(stores):
        return None
    return stores


def _shape_func_name(index: int) -> str:
    return "shape_func" if index == 0 else f"shape_func{index}"


def order_shape_funcs() -> tvm.transform.Pass:
    """VMShapeLower's shape functions in a canonical form: each one's stores in heap-slot order,
    the structurally equal ones merged, and the rest named shape_func, shape_func1, ... in the
    order the Relax functions (by name) first call them.

    VMShapeLower (TVM 0.27) emits a shape function's stores in the order it meets the computed
    slots while iterating an unordered_map keyed by the structural hash of each PrimExpr, and the
    hash of a symbolic var is its address: the order changed from one process to the next, and
    with it the host code's instructions and, as its BlockBuilder merges a new shape function into
    an equal one already added, how many shape functions there were and their names (symbols in
    the library). The stores are independent (each writes one computed slot from the symbolic
    vars' slots, which the function does not write), so any order computes the same."""

    @tvm.transform.module_pass(opt_level=0, name="OrderShapeFuncs")
    def apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        shape = {
            gv.name_hint: (gv, f)
            for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and gv.name_hint.startswith("shape_func")
        }
        if not shape:
            return mod
        ordered: dict[str, tirx.PrimFunc] = {}
        for name, (_gv, f) in shape.items():
            stores = _shape_func_stores(f)
            if stores is None:  # not the form VMShapeLower emits: leave the module as it is
                return mod
            stores.sort(key=lambda s: s[0])
            ordered[name] = f.with_body(tirx.SeqStmt([st for _, st in stores])) if len(stores) > 1 else f
        names = [_shape_func_name(i) for i in range(len(shape))]
        if sorted(shape) != sorted(names):
            return mod

        # Shape functions in the order of their first call (Relax functions taken by name).
        first_calls: list[str] = []

        def note_call(expr: relax.Expr) -> None:
            op = getattr(expr, "op", None) if isinstance(expr, relax.Call) else None
            if isinstance(op, tvm.ir.GlobalVar) and op.name_hint in shape and op.name_hint not in first_calls:
                first_calls.append(op.name_hint)

        relax_funcs = sorted(
            ((gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)),
            key=lambda item: item[0].name_hint,
        )
        for _gv, f in relax_funcs:
            relax.analysis.post_order_visit(f, note_call)
        first_calls += sorted(n for n in shape if n not in first_calls)

        # Merge equal ones; the k distinct functions take the first k names.
        distinct: list[tirx.PrimFunc] = []
        index_of: dict[str, int] = {}
        for name in first_calls:
            f = ordered[name]
            same = next((i for i, g in enumerate(distinct) if tvm_ffi.structural_equal(f, g)), None)
            if same is None:
                distinct.append(f)
                same = len(distinct) - 1
            index_of[name] = same

        out = mod.clone()
        for i, f in enumerate(distinct):
            out.update_func(shape[names[i]][0], f)
        rename = {old: shape[names[i]][0] for old, i in index_of.items() if names[i] != old}
        if rename:

            def remap(gv: tvm.ir.GlobalVar) -> tvm.ir.GlobalVar:
                return rename.get(gv.name_hint, gv)

            for gv, f in relax_funcs:
                out.update_func(gv, tvm_ffi.structural_map(f, [(tvm.ir.GlobalVar, remap)]))
        for name in names[len(distinct) :]:
            del out[shape[name][0]]
        return out

    return apply


def cap_lanes(lanes: int) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="CapVectorLanes")
    def apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return cap_vector_lanes(mod, lanes)

    return apply


# -- kernels with an ISA-specific form ------------------------------------------------------------
# A model is exported once and compiled for every tier, so a kernel that only some tiers can run
# (an intrinsic LLVM cannot select elsewhere) is exported in its portable form, carrying the others
# under this attribute as (LLVM CPU feature, PrimFunc) pairs, best first; compiling swaps in the
# first whose feature the target has. Every form keeps the same signature.
ISA_VARIANTS = "goinfer.isa_variants"


def with_isa_variants(portable: tirx.PrimFunc, variants: list[tuple[str, tirx.PrimFunc]]) -> tirx.PrimFunc:
    return portable.with_attr(ISA_VARIANTS, [[feature, f] for feature, f in variants])


def pick_isa_variants(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Each tagged PrimFunc replaced by its form for `target` (attributes other than the tag kept)."""
    feats = codegen.llvm_get_cpu_features(target)
    out = mod.clone()
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or ISA_VARIANTS not in func.attrs:
            continue
        chosen = next((f for feature, f in func.attrs[ISA_VARIANTS] if str(feature) in feats), func)
        for key, value in func.attrs.items():
            if key != ISA_VARIANTS:
                chosen = chosen.with_attr(key, value)
        out.update_func(gv, chosen.without_attr(ISA_VARIANTS))
    return out


def param_dtype(func: tirx.PrimFunc, index: int) -> str:
    """The element type of a PrimFunc's buffer parameter (0.27 types the parameter itself; older
    releases kept it in `func.buffer_map`)."""
    return str(func.params[index].ty.dtype)


def without_params(func: tirx.PrimFunc, indices: list[int]) -> tirx.PrimFunc:
    """`func` without the parameters at `indices`, which its body must not use (TVMScript cannot
    spell a signature whose length depends on Python values)."""
    keep = [p for i, p in enumerate(func.params) if i not in set(indices)]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


def vpdpbusd_512(acc, a, b):
    """AVX-512 VNNI: each int32 lane of acc (int32x16) plus the 4 products of its bytes, u8 of `a`
    times s8 of `b` (both int32x16). LLVM 22 retyped the byte operands as <64 x i8>."""
    if codegen.llvm_version_major() >= 22:
        a, b = tirx.reinterpret("int8x64", a), tirx.reinterpret("int8x64", b)
    return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, a, b)


def prefetch_read(address, once: bool = False):
    """Software prefetch of the line at `address` for reading, into every cache level, or with
    `once` as non-temporal (prefetchnta: data read once, kept from displacing what stays cached;
    `specialize` keeps that only on the CPUs where it pays). The intrinsic's name carries the
    pointer type since LLVM's opaque pointers."""
    return tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 0 if once else 3, 1)


def specialize(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The kernels of `mod` as `target` runs them: each tagged PrimFunc's ISA form, and its
    non-temporal prefetches kept only where they pay. A GPU's graph has neither."""
    if target.kind.name != "llvm":
        return mod
    mod = pick_isa_variants(mod, target)
    if targets.nontemporal_prefetch_pays(target):
        return mod
    probe = prefetch_read(tirx.IntImm("int64", 0), once=True)

    def keep_cached(call: tvm.ir.Call) -> tvm.ir.Call:
        same = call.op.same_as(probe.op) and len(call.args) == len(probe.args)
        if same and int(call.args[0]) == int(probe.args[0]) and int(call.args[3]) == int(probe.args[3]):
            return prefetch_read(call.args[1], once=False)
        return call

    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            out.update_func(gv, tvm_ffi.structural_map(func, [(tvm.ir.Call, keep_cached)]))
    return out
