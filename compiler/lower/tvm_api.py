"""Every TVM call that tends to change between releases, in one place (written against TVM 0.27).

If a TVM upgrade breaks the build, this file and schedules.py are where to look.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Iterator
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import _attribute_finder
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.s_tir import dlight
from tvm.target import Target, codegen

from ..spec import ModelSpec

__all__ = [
    "PagedKVCache",
    "Target",
    "attention_with_fused_qkv",
    "compile_module",
    "export",
    "host_target",
    "kv_cache_type",
    "modules_of_type",
    "paged_kv_cache",
]

TVM_VERSION: str = tvm.__version__

# These VMs advertise AMX, but its instructions fault (SIGILL): never let LLVM emit them.
_NO_AMX = ("-amx-tile", "-amx-int8", "-amx-bf16", "-amx-fp16", "-amx-complex")


def host_target(num_cores: int | None = None) -> dict[str, Any]:
    """The host CPU as a target dict: its ISA, its core count, and AMX switched off."""
    import os

    return {
        "kind": "llvm",
        "mtriple": "x86_64-linux-gnu",
        "mcpu": codegen.llvm_get_system_cpu(),
        "mattr": list(_NO_AMX),
        "num-cores": num_cores or os.cpu_count() or 1,
    }


def make_target(target: dict[str, Any]) -> Target:
    return Target(target)


# -- GPU targets ----------------------------------------------------------------------------------
DEFAULT_CUDA_ARCH = "sm_90"  # the H200/H100; its PTX is embedded too, so newer GPUs can JIT it


def cuda_target(arch: str = DEFAULT_CUDA_ARCH, num_cores: int | None = None) -> dict[str, Any]:
    """A CUDA GPU of compute capability `arch` ("sm_90"), the host side for this CPU."""
    return {
        "kind": "cuda",
        "arch": arch,
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32,
        "host": host_target(num_cores),
    }


# Metal's vector types stop at 4 lanes: codegen refuses float16x8, so schedules for it must not
# vectorize wider (see cap_vector_lanes).
METAL_MAX_LANES = 4


def metal_target() -> dict[str, Any]:
    """An Apple-silicon GPU; the host side is arm64 macOS, linked on the Mac that loads it."""
    return {
        "kind": "metal",
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 32768,
        "thread_warp_size": 32,
        "host": {"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"},
    }


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


@contextlib.contextmanager
def cuda_compiler() -> Iterator[None]:
    """Where TVM compiles CUDA itself (a host whose CUDA runtime is loaded), compile to
    `compile_cuda_source`'s fatbin rather than TVM's default single-arch NVRTC cubin."""
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    tvm_ffi.register_global_func(
        "tvm_callback_cuda_compile", lambda code: compile_cuda_source(code, Target.current()), override=True
    )
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous, override=True)


def cuda_source(executable) -> str:
    """The CUDA C++ of a compiled executable's kernels. Without a loaded CUDA runtime (any host
    without a driver) TVM 0.27 keeps the kernels as source, to be compiled when the module loads;
    the build compiles them now instead (`compile_cuda_source`)."""

    def walk(m):
        yield m
        for child in m.imports:
            yield from walk(child)

    found = [m for m in walk(executable.mod) if m.kind == "cuda"]
    return found[0].inspect_source("cuda") if found else ""


def _nvcc_path() -> str | None:
    from tvm.support import nvcc

    found = shutil.which("nvcc")
    if found:
        return found
    try:
        home = nvcc.find_cuda_path()
    except RuntimeError:
        return None
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def cuda_compiler_name() -> str | None:
    """The CUDA compiler here: "nvcc" (first: it embeds PTX), "nvrtc", or None for neither."""
    if _nvcc_path() is not None:
        return "nvcc"
    try:
        from cuda.bindings import nvrtc  # noqa: F401  (cuda-bindings and nvidia-cuda-nvrtc)
    except ImportError:
        return None
    return "nvrtc"


def compile_cuda_source(source: str, target: Target) -> bytes:
    """`source` compiled for `target`'s arch: with nvcc, a fatbin holding the arch's SASS and its
    PTX, so a newer GPU can JIT it; without nvcc, NVRTC's SASS alone (pip install
    'goinfer[cuda-build]')."""
    from tvm.support import nvcc

    arch = str(target.attrs["arch"]).removeprefix("sm_")
    with target:
        if cuda_compiler_name() == "nvcc":
            gencode = ["-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
            return bytes(nvcc.compile_cuda(source, target_format="fatbin", arch=gencode, compiler="nvcc"))
        return bytes(nvcc.compile_cuda(source, target_format="cubin", arch=f"sm_{arch}", compiler="nvrtc"))


def modules_of_type(root: nn.Module, cls: type) -> list[tuple[str, Any]]:
    """(dotted name, module) for every sub-module of `root` that is an instance of `cls`."""
    return list(_attribute_finder(root, "", condition_yield=lambda x: isinstance(x, cls)))


def export(model: nn.Module, spec: nn.spec.ModuleSpec) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
    mod, params = model.export_tvm(spec=spec)
    return mod, params


def kv_window(spec: ModelSpec) -> int:
    """The window the cache's sliding-layer kernels are built for (unused without sliding layers)."""
    return spec.sliding_window or 1024


def paged_kv_cache(
    spec: ModelSpec,
    target: Target,
    max_batch_size: tirx.Var,
    max_total_seq_len: tirx.Var,
    prefill_chunk_size: tirx.Var,
    page_size: tirx.Var,
    dtype: str,
) -> PagedKVCache:
    """TVM's paged KV cache with its CPU (TIR) attention kernels, its pages in `dtype` ("float16"
    or "float32"); the cache also takes q/k/v and gives the attention output in it, so each
    layer's `attention_with_fused_qkv` casts to and from it.

    RoPE is applied by the model itself (RopeMode.NONE), since gemma3 needs two bases and QK-norm
    before rotation; the cache only stores and attends.
    """
    kinds = ["mha_sliding" if w else "mha" for w in spec.sliding_layers] or "mha"
    return TIRPagedKVCache(
        attn_kind=kinds,
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        page_size=page_size,
        support_sliding_window=0,
        layer_partition=relax.ShapeExpr([0, spec.num_layers]),
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        qk_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NONE,
        rope_scale=1,
        rope_theta=int(spec.rope_theta),
        rope_scaling={},
        rope_ext_factors=tirx.IntImm("int64", 0),
        rotary_dim=spec.head_dim,
        enable_disaggregation=False,
        dtype=dtype,
        target=target,
        layer_sliding_window_size=kv_window(spec),
    )


class _TypedKVCache(PagedKVCache):
    """The cache as an entry point's argument, knowing the dtype it was created with."""

    kv_dtype: str = "float32"


@functools.cache
def kv_cache_type(dtype: str) -> type[PagedKVCache]:
    """The object type of an entry point's cache argument (`nn.spec.Object(object_type=...)`)
    for a cache created in `dtype`: each layer's `attention_with_fused_qkv` reads the dtype off
    the argument, so it needs no parameter of its own (and cannot disagree with the cache)."""
    return type(f"PagedKVCache_{dtype}", (_TypedKVCache,), {"kv_dtype": dtype})


def attention_with_fused_qkv(
    kv: PagedKVCache, layer: int, qkv: nn.Tensor, heads: int, sm_scale: float
) -> nn.Tensor:
    """The cache's attention for one layer on a fused qkv of (tokens, q + k + v heads, dim),
    returning (tokens, heads, dim) in qkv's dtype. `PagedKVCache.attention_with_fused_qkv` takes
    and returns (batch, tokens, heads, dim) and views to and from the 3-D form the builtin works
    on: two views a decode layer, each a VM instruction and an object (one sequence here: batch 1).

    The builtin takes qkv and gives the output in the cache's dtype (`kv_cache_type`; float32 for
    an untyped cache): in another, qkv is cast to it before (fused into the RoPE kernel) and the
    output back after (a small kernel of its own: the output projection takes float32)."""
    t, _, d = qkv.shape
    dtype = getattr(kv, "kv_dtype", "float32")
    fused = qkv if qkv.dtype == dtype else qkv.astype(dtype)
    out = nn.Tensor(
        _expr=relax.BlockBuilder.current().emit(
            relax.call_dps_packed(
                "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
                [kv._expr, relax.prim_value(layer), relax.prim_value(sm_scale), fused._expr],
                out_ty=relax.TensorType((t, heads, d), dtype),
            )
        )
    )
    return out if dtype == qkv.dtype else out.astype(qkv.dtype)


def compile_module(mod: tvm.IRModule, target: Target, schedule_rules: list[dlight.ScheduleRule]):
    """Lower a Relax module for a CPU target and build it into an executable."""

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = specialize(mod, target)
        passes = [
            relax.backend.DispatchSampling(),
            relax.backend.DispatchSortScan(),
            relax.transform.LegalizeOps(),
            # Reshapes become views before fusion: fused, a chain of them (a linear's 2-D view of
            # a 3-D activation and back) was a copy kernel with a temporary, 3 a decode layer.
            relax.transform.RewriteDataflowReshape(),
            relax.transform.RemoveRedundantReshape(),  # a chain of views: one view
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
            dlight.ApplyDefaultSchedule(*schedule_rules),
            *([cap_lanes(METAL_MAX_LANES)] if target.kind.name == "metal" else []),
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
            relax.transform.StaticPlanBlockMemory(),
            relax.transform.LowerAllocTensor(),
            relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(),
            relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(),
            order_shape_funcs(),
            relax.transform.AttachGlobalSymbol(),
        ]
        with target:
            return tvm.transform.Sequential(passes)(mod)

    with target, cuda_compiler() if target.kind.name == "cuda" else contextlib.nullcontext():
        return tvm.compile(mod, target, relax_pipeline=pipeline)


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


# Linked with an explicit content-derived build id: toolchains that default to none or to a random
# one would otherwise differ from the ones (Debian's gcc) that pass sha1.
_LINK_OPTIONS = ["-Wl,--build-id=sha1"]


def export_library(executable, path: str) -> None:
    """A shared library; for a path ending .tar, the unlinked objects (Metal: the host code is
    arm64 Mach-O, linked on the Mac that loads it), as a reproducible tar (`_reproducible_tar`).
    The same module exported twice, in two processes, gives the same bytes."""
    if path.endswith(".tar"):
        executable.export_library(path, fcompile=_reproducible_tar)
    else:
        executable.export_library(path, options=_LINK_OPTIONS)


def _reproducible_tar(output: str, files: list[str]) -> None:
    """`files` in an uncompressed tar at `output`, by base name in sorted order, with no time,
    owner or mode of this machine in it. (TVM's own `tar.tar` gzips the temp copies' listing in
    directory order, stamped with the time, user and group of the build: no two builds agree.)"""
    import io
    import tarfile

    names = [os.path.basename(f) for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate file names among {names}")
    with tarfile.open(output, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, file in sorted(zip(names, files, strict=True)):
            with open(file, "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


_reproducible_tar.output_format = "tar"  # what TVM's tar.tar declares


# -- CPU ISA tiers --------------------------------------------------------------------------------
# A bundle carries its model compiled for the host's best tier and for the next tier below it
# (AVX2, or on an AVX2 host the generic x86-64-v2 forms), so a runtime whose self-test finds the
# best tier's kernels wrong can step down instead of returning wrong numbers.
TIER_ORDER = ("avx512-vnni", "avx512", "avx2", "sse")
FALLBACK_TIERS = (("avx2", "haswell"), ("sse", "x86-64-v2"))


def host_tier_name() -> str:
    """The best x86 feature level the host's LLVM CPU has, as a short tier name."""
    feats = codegen.llvm_get_cpu_features(make_target(host_target(1)))
    if "avx512vnni" in feats:
        return "avx512-vnni"
    if "avx512f" in feats:
        return "avx512"
    return "avx2" if "avx2" in feats else "sse"


def cpu_tiers(num_cores: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(tier name, target) from the best tier down; the first is the host's own ISA."""
    host = host_target(num_cores)
    best = host_tier_name()
    below = [(n, mcpu) for n, mcpu in FALLBACK_TIERS if TIER_ORDER.index(n) > TIER_ORDER.index(best)]
    return [(best, host), *((n, {**host, "mcpu": mcpu}) for n, mcpu in below[:1])]


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


def nontemporal_prefetch_pays(target: Target) -> bool:
    """Whether decode's read-once weight stream should be prefetched non-temporal on `target`.

    AMD Zen: yes. Decode 3-6% faster a token (Zen 3, AVX2: the stream stops evicting the step's
    code and data). Intel: no. The decode GEMVs read 12-17 GB/s with it against 25-29 GB/s with
    the ordinary prefetch (2-core Xeon with AVX-512 VNNI, int4 and int8int8, every model shape;
    26-30 GB/s plain read), likely as its prefetchnta fills L1 only, out of the L2 streamer's sight.
    """
    return str(target.attrs.get("mcpu", "")).startswith("znver")


def specialize(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The kernels of `mod` as `target` runs them: each tagged PrimFunc's ISA form, and its
    non-temporal prefetches kept only where they pay. A GPU's graph has neither."""
    if target.kind.name != "llvm":
        return mod
    mod = pick_isa_variants(mod, target)
    if nontemporal_prefetch_pays(target):
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


def compile_kernels(funcs: dict[str, tirx.PrimFunc], target: dict[str, Any], path: str) -> None:
    """Compile standalone TIR kernels (each callable by its name) into a shared library."""
    tgt = make_target(target)
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    mod = specialize(mod, tgt)
    with tgt:
        mod = dlight.ApplyDefaultSchedule(*_schedule_rules())(mod)
    export_library(tvm.compile(mod, tgt), path)


def _schedule_rules():
    from .schedules import cpu_rules

    return cpu_rules()
