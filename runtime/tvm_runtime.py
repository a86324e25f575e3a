"""The runtime's CPU door to TVM: libtvm_runtime through tvm_ffi, never the compiler.

A cold start pays for every import, so this module does not `import tvm` (its Python package costs
~0.15 s on top of the library here, measured). It loads libtvm_runtime itself, next to tvm_ffi, and
drives the Relax VM through the packed functions the library registers. It is not the only one:
cuda.py (the CUDA door) loads TVM's CUDA runtime beside it and calls tvm_ffi itself, and model.py,
kv_pool.py, selftest.py and gpu_selftest.py call through this module; none of them imports the tvm
package. A compiler in the same process (a build, the tests) imports tvm as usual; both then share
the one loaded runtime library. One builtin is replaced, the paged KV cache's constructor, by a
wrapper that lets export_sequence and import_sequence reach the cache's pages and routes a CPU
cache's prefill attention through one kernel (see `_route_prefill`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import threading
from pathlib import Path

import numpy as np
import tvm_ffi
from tvm_ffi import Shape, core
from tvm_ffi.libinfo import load_lib_ctypes

from . import threads

_CPU_DEVICE_TYPE = 1  # kDLCPU
_POOLED_ALLOCATOR = 2  # the VM's memory pool: kernel outputs are reused between calls
_ALIGN = 64  # TVM kernels assume 64-byte aligned buffers


def _avoid_lookup_misses() -> None:
    """Make unknown type-key lookups cheap.

    tvm_ffi's class registration looks every Python class's type key up in the C++ type table, and
    a key the library does not have raises a C++ error whose backtrace is built with libbacktrace.
    The first one reads the debug info of every loaded library (libpython's among them: 0.4 s here,
    on a cold start of ~1 s). Answering misses from the table's own key list skips that.
    """
    lookup = getattr(core, "_object_type_key_to_index", None)
    list_keys = tvm_ffi.get_global_func("ffi.GetRegisteredTypeKeys", allow_missing=True)
    if lookup is None or list_keys is None:
        return
    known: set[str] = set()

    def key_to_index(key: str):
        nonlocal known
        if key not in known:
            known = set(list_keys())  # libraries loaded since add their keys
            if key not in known:
                return None  # what the lookup itself answers for a miss
        return lookup(key)

    core._object_type_key_to_index = key_to_index


def tvm_lib_dir() -> Path | None:
    """The folder holding TVM's runtime libraries (the tvm package's lib/, found without
    importing the package), or None without one."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _load_runtime_library() -> None:
    if tvm_ffi.get_global_func("vm.builtin.reshape", allow_missing=True) is not None:
        return  # already loaded (by `import tvm`, or earlier here)
    lib_dir = tvm_lib_dir()
    if lib_dir is None:
        raise ImportError("goinfer needs the apache-tvm package (its runtime library)")
    # RTLD_GLOBAL, as tvm itself loads it: compiled modules resolve their runtime symbols from it.
    load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=[lib_dir])


_avoid_lookup_misses()
THREADS = threads.configure()  # before the pool's first use, which reads it
_load_runtime_library()

_add_sequence = tvm_ffi.get_global_func("vm.builtin.kv_state_add_sequence")
_remove_sequence = tvm_ffi.get_global_func("vm.builtin.kv_state_remove_sequence")
_begin_forward = tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")
_end_forward = tvm_ffi.get_global_func("vm.builtin.kv_state_end_forward")
_popn = tvm_ffi.get_global_func("vm.builtin.kv_state_popn")
_fork = tvm_ffi.get_global_func("vm.builtin.kv_state_fork_sequence")
_available_pages = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_get_num_available_pages")
_sequence_length = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_get_sequence_length")
_layout_hash = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_get_layout_hash")
_debug_get_kv = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv")
_commit_tree = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes")
_query_positions = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_get_query_positions")
_reserve_slots = tvm_ffi.get_global_func("vm.builtin.kv_cache_disagg_prepare_recv")
_checkpoint = {
    name: tvm_ffi.get_global_func(f"vm.builtin.attention_kv_cache_{name}")
    for name in (
        "get_checkpoint_metadata",
        "export_page_group",
        "prepare_import",
        "import_page_group",
        "finish_import",
    )
}


# -- the cache's page tensors (export_sequence, import_sequence) -----------------------------------
# TVM never hands out a cache's page tensors, but it passes them, one layer at a time, to the
# kernels the cache was created with. So the constructor builtin is wrapped (before any VM looks it
# up: the VM resolves builtins when it is initialized): two of the kernels it is given, which no
# forward pass calls, go to the cache as Python functions that note their arguments while a
# capture is on and run the real kernel otherwise. Their places among the constructor's 28
# arguments are TVM 0.27's (paged_kv_cache.cc, "vm.builtin.paged_attention_kv_cache_create").
_CREATE_CACHE = "vm.builtin.paged_attention_kv_cache_create"
_create_cache = tvm_ffi.get_global_func(_CREATE_CACHE)
_DEBUG_GET_KV_ARG = 26  # f_debug_get_kv(pages, position_map, k, v, layer): DebugGetKV only
_COMPACT_COPY_ARG = 27  # f_compact_copy(pages, ...): a token tree's commit only
_ATTN_KINDS = ("mha", "mla", "linear", "mha_sliding")  # AttnKind's values, as TVM names them


class _Capture(threading.local):
    active = False
    pages: list
    positions: np.ndarray | None
    attn_kinds: tuple[str, ...]


_capture = _Capture()


@contextlib.contextmanager
def _capturing():
    _capture.active, _capture.pages, _capture.positions, _capture.attn_kinds = True, [], None, ()
    try:
        yield _capture
    finally:
        _capture.active = False


def _recorder(kernel, attn_kinds: tuple[str, ...], positions: bool):
    def run(*args):
        if not _capture.active:
            return kernel(*args)
        _capture.pages.append(args[0])  # called layer by layer, in order
        _capture.attn_kinds = attn_kinds
        if positions:  # a fresh tensor, freed when the call returns
            _capture.positions = np.from_dlpack(args[1]).copy()
        return None

    return tvm_ffi.convert(run)


# -- one-pass prefill attention ---------------------------------------------------------------
# TVM's cache attends a prefill chunk in two calls, the chunk to itself (ragged) and to the
# history (paged), then merges them: a query's output would depend on where its chunk began, and
# warm prompts could only resume where a cold run's chunk did. goinfer's CPU kernels put one
# kernel in the paged slots (compiler/kernels/attention.py `prefill`) that attends to both in an
# order fixed by key position; these three functions, in the cache's ragged, paged and merge
# slots, route TVM's calls to it: the ragged call notes the chunk's K/V and the layer's output
# and runs the sequences without history, the paged call runs the others into that output, and
# the merge has nothing left to do. Their places among the constructor's arguments are TVM 0.27's.
_RAGGED_ARG, _PAGED_ARG, _PAGED_SLIDING_ARG, _MERGE_ARG = 15, 16, 18, 23
_DTYPE_ARG, _KV_HEADS_ARG, _HEAD_DIM_ARG = 12, 3, 4


class _PrefillRoute:
    """One cache's routing. `scalars` are the stock kernels' last five arguments: causal, rotary
    mode, rope scale and theta, softmax scale (ours read the last only)."""

    def __init__(self, plain, dtype: str, kv_heads: int, head_dim: int):
        self.plain = plain  # the one-pass kernel of layers without a window
        self.chunk: tuple = ()  # the ragged call's K, V, kv indptr, history lengths, output, lse
        # stand-ins for the page table in the ragged call's place (read by no sequence there)
        self.no_pages = tvm_ffi.from_dlpack(_aligned_empty((1, 2, kv_heads, 16, head_dim), dtype))
        self.no_table = int32_tensor([0])

    def ragged(self, q, q_indptr, k, v, kv_indptr, q_rope, history, out, lse, *scalars) -> None:
        """The chunk to itself: noted, and its sequences without history attended (mode 0; a chunk
        is shorter than any window, so the windowless kernel serves every layer)."""
        self.chunk = (k, v, kv_indptr, history, out, lse)
        t = self.no_table
        self.plain(q, q_indptr, self.no_pages, t, t, t, history, q_rope, out, lse, *scalars, k, v, kv_indptr,
                   history, 0)  # fmt: skip

    def paged(self, kernel):
        """The chunk to the history: every sequence with some, over its pages and its chunk (mode
        1), into the ragged call's output (the one the layer reads)."""

        def run(q, q_indptr, pages, page_indptr, values, info, k_rope, q_rope, _out, _lse, *scalars) -> None:
            k, v, kv_indptr, history, out, lse = self.chunk
            kernel(q, q_indptr, pages, page_indptr, values, info, k_rope, q_rope, out, lse, *scalars, k, v,
                   kv_indptr, history, 1)  # fmt: skip

        return run

    @staticmethod
    def merge(*_args) -> None:
        """Nothing to merge: the paged call wrote the whole result."""


def _route_prefill(args: list) -> None:
    """Route a CPU cache's prefill attention through one kernel (see above); a GPU cache keeps
    TVM's stock kernels and their merge."""
    init = args[_DTYPE_ARG]
    if init.device.dlpack_device_type() != _CPU_DEVICE_TYPE:
        return
    backend, plain = args[_PAGED_ARG]
    route = _PrefillRoute(plain, str(init.dtype), int(args[_KV_HEADS_ARG]), int(args[_HEAD_DIM_ARG]))
    args[_RAGGED_ARG] = tvm_ffi.convert([backend, route.ragged])
    args[_PAGED_ARG] = tvm_ffi.convert([backend, route.paged(plain)])
    args[_PAGED_SLIDING_ARG] = tvm_ffi.convert([backend, route.paged(args[_PAGED_SLIDING_ARG][1])])
    args[_MERGE_ARG] = tvm_ffi.convert([route.merge, *list(args[_MERGE_ARG])[1:]])


def _create_recording_cache(*args):
    args = list(args)
    if len(args) in (28, 29):  # TVM 0.27's two forms (the 29th, last, is unused)
        layers = int(args[1][-1]) - int(args[1][0])  # the layer partition: the cache's layers
        # (a windowed-everywhere model's graph names one kind more: compiler/tvm/graph.py)
        kinds = tuple(dict(enumerate(_ATTN_KINDS)).get(int(k), str(k)) for k in args[6])[:layers]
        args[_DEBUG_GET_KV_ARG] = _recorder(args[_DEBUG_GET_KV_ARG], kinds, positions=True)
        args[_COMPACT_COPY_ARG] = _recorder(args[_COMPACT_COPY_ARG], kinds, positions=False)
        _route_prefill(args)
    return _create_cache(*args)


tvm_ffi.register_global_func(_CREATE_CACHE, _create_recording_cache, override=True)


_CUDA_DEVICE_TYPE = 2  # kDLCUDA
DEVICE_TYPES = {"cpu": _CPU_DEVICE_TYPE, "cuda": _CUDA_DEVICE_TYPE}


def load_vm(library_path: str, device: str = "cpu", device_id: int = 0):
    """The Relax VM over a compiled library, on `device` ("cpu" | "cuda") with the pooled
    allocator; index it by entry point name (`vm["decode"]`). A GPU's VM takes the CPU too, last,
    as its host (shape arithmetic runs there)."""
    vm = tvm_ffi.load_module(library_path)["vm_load_executable"]()
    devices = [(DEVICE_TYPES[device], device_id)] + ([(_CPU_DEVICE_TYPE, 0)] if device != "cpu" else [])
    vm["vm_initialization"](*(x for kind, i in devices for x in (kind, i, _POOLED_ALLOCATOR)))
    return vm


def wrap(array: np.ndarray):
    """A TVM tensor over the same memory (DLPack, no copy). `array` must be writable and aligned
    (bundle blobs are)."""
    return tvm_ffi.from_dlpack(array)


def tensor_list(tensors: list):
    """A list of TVM tensors as one TVM array: a model's parameters, converted once rather than on
    every call (a Python list of ~300 tensors cost ~10 us a call)."""
    return tvm_ffi.convert(tensors)


def data_pointer(t) -> int:
    """The address of a TVM tensor's first byte (tests use it to prove zero-copy)."""
    return int(t.data_ptr())


def _aligned_empty(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _aligned_copy(values, dtype) -> np.ndarray:
    src = np.asarray(values, dtype=dtype)
    out = _aligned_empty(src.shape, src.dtype)
    out[...] = src
    return out


def tensor(values, dtype=None):
    """A TVM tensor holding a copy of `values` in fresh, aligned memory."""
    return tvm_ffi.from_dlpack(_aligned_copy(values, dtype))


def int32_tensor(values):
    return tensor(values, np.int32)


def scalar_int32() -> tuple[np.ndarray, object]:
    """A one-element int32 array and a TVM tensor over the same memory: write the array, then
    pass the tensor (no allocation a call)."""
    array = _aligned_copy([0], np.int32)
    return array, tvm_ffi.from_dlpack(array)


def create_kv_cache(vm, max_batch: int, max_total: int, prefill_chunk: int, page_size: int):
    return vm["create_kv_cache"](
        Shape([max_batch]), Shape([max_total]), Shape([prefill_chunk]), Shape([page_size])
    )


def add_sequence(kv, seq_id: int) -> None:
    _add_sequence(kv, seq_id)


def remove_sequence(kv, seq_id: int) -> None:
    _remove_sequence(kv, seq_id)


@functools.lru_cache(maxsize=256)
def _shape(dims: tuple[int, ...]) -> Shape:
    return Shape(list(dims))  # immutable: decode asks for the same two every step


def begin_forward(kv, seq_ids: list[int], lengths: list[int]) -> None:
    _begin_forward(kv, _shape(tuple(seq_ids)), _shape(tuple(lengths)))


def end_forward(kv) -> None:
    _end_forward(kv)


def pop_tokens(kv, seq_id: int, n: int) -> None:
    _popn(kv, seq_id, n)


def fork_sequence(kv, parent: int, child: int, at: int) -> None:
    """A new sequence `child` holding `parent`'s first `at` tokens: full pages shared, the partial
    page at the fork point copied."""
    _fork(kv, parent, child, at)


def available_pages(kv) -> int:
    return int(_available_pages(kv))


# TVM's KV checkpoint works on sequence 0 only, and importing one empties the whole cache
# (export_sequence and import_sequence, below, work on any sequence).
def export_sequence0(kv) -> tuple[str, list[np.ndarray]]:
    """Sequence 0's KV: TVM's checkpoint metadata (JSON) and one array per layer group. Raises
    where TVM cannot export the cache (sliding-window layers)."""
    metadata = str(_checkpoint["get_checkpoint_metadata"](kv, 0))
    groups = []
    for g in json.loads(metadata)["groups"]:
        out = _aligned_copy(np.zeros(g["shape"], np.dtype(g["dtype"])), np.dtype(g["dtype"]))
        _checkpoint["export_page_group"](kv, 0, g["group_index"], tvm_ffi.from_dlpack(out))
        groups.append(out)
    return metadata, groups


def import_sequence0(kv, metadata: str, groups: list[np.ndarray]) -> None:
    """Sequence 0 from an export; every other sequence in the cache is dropped."""
    _checkpoint["prepare_import"](kv, 0, metadata)
    for g, data in zip(json.loads(metadata)["groups"], groups, strict=True):
        _checkpoint["import_page_group"](kv, 0, g["group_index"], tensor(data))
    _checkpoint["finish_import"](kv, 0)


# -- any sequence's KV, the others untouched --------------------------------------------------
# TVM 0.27's checkpoint refuses every sequence but 0 and its import starts with Clear()
# (paged_kv_cache.cc: CheckCheckpointSequenceState, PrepareImport). These copy the pages
# themselves, in the checkpoint's format (one array per layer, (1, pages, 2, kv_heads, page_size,
# head_dim)), so either side reads the other's files. What they need from TVM:
# * where a sequence's new tokens go: kv_cache_disagg_prepare_recv is BeginForward for one
#   sequence that returns the slots it reserved (any sequence, any layer kind, no transfer needed);
# * where a sequence's tokens are: DebugGetKV passes their slots to f_debug_get_kv (full-attention
#   layers only; otherwise see _slots_by_round_trip);
# * the page tensors themselves: the recorders above.
_SCRATCH_SEQ = 1 << 62  # the page capture's sequence: an id no caller uses
_GROUP_LAYOUT = "1,num_logical_pages,2,num_kv_heads,page_size,qk_head_dim"  # TVM's, checkpoint v1


def _page_tensors(kv) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """Every layer's pages, (num_pages, 2, kv_heads, page_size, head_dim) views of the cache's own
    memory, and its layers' attention kinds. A token tree of two roots on a scratch sequence,
    committed to its second node, makes the cache call its compact-copy kernel on every layer
    (CommitAcceptedTokenTreeNodes -> CompactKVCopy); the recorder notes the pages and copies
    nothing. The commit reads the forward's offsets from the arrays an attention call syncs
    (SyncAuxArrayToDevice), and no attention runs here: get_query_positions syncs them. Takes
    one free page while it runs."""
    if available_pages(kv) < 1:
        raise ValueError("the KV cache has no free page (copying a sequence's KV in or out takes one)")
    ids = _shape((_SCRATCH_SEQ,))
    _add_sequence(kv, _SCRATCH_SEQ)
    try:
        _begin_forward(kv, ids, _shape((2,)), _shape((-1, -1)))
        _query_positions(kv)  # syncs the forward's aux arrays, which the commit indexes
        _end_forward(kv)
        with _capturing() as cap:
            _commit_tree(kv, ids, _shape((1,)))
    finally:
        _remove_sequence(kv, _SCRATCH_SEQ)
    if not cap.pages:
        raise RuntimeError("this KV cache's VM was initialized before goinfer's runtime was imported")
    if any(t.device.dlpack_device_type() != _CPU_DEVICE_TYPE for t in cap.pages):
        raise ValueError("KV pages are copied in and out of a CPU cache only")
    return [np.from_dlpack(t) for t in cap.pages], cap.attn_kinds


def _reserve(kv, seq_id: int, n: int) -> np.ndarray:
    """Append `n` tokens' room to `seq_id` without computing them: their slots (page * page_size
    + offset). The pages are the cache's from here on; nothing is written into them."""
    compressed = [int(x) for x in _reserve_slots(kv, seq_id, n)]  # [runs, start, length, ...]
    _end_forward(kv)
    runs = zip(compressed[1::2], compressed[2::2], strict=True)
    return np.concatenate([np.arange(start, start + k) for start, k in runs])


def _slots_by_debug_get_kv(kv, seq_id: int, length: int, pages: list[np.ndarray]) -> np.ndarray:
    _, _, heads, _, dim = pages[0].shape
    out = tvm_ffi.from_dlpack(_aligned_empty((len(pages), length, heads, dim), pages[0].dtype))
    with _capturing() as cap:  # the kernel is skipped: `out` is never written
        _debug_get_kv(kv, seq_id, 0, length, out, out)
    return cap.positions


def _slots_by_round_trip(kv, seq_id: int, length: int, page_size: int) -> np.ndarray:
    """Pop the whole sequence and reserve it again. PopN frees a block's pages last first onto a
    stack (free_page_ids_) and ReserveAppendLengthInSeq takes them back from its top, so the
    sequence gets its own pages again, in order, their bytes untouched, and the reservation says
    where they are. For a sequence whose blocks are its own (never forked): a block shared with
    another sequence is not freed, which the page count sees; that sequence's KV is then lost."""
    before = available_pages(kv)
    _popn(kv, seq_id, length)
    freed = available_pages(kv) - before
    slots = _reserve(kv, seq_id, length)
    if freed != -(-length // page_size):
        raise RuntimeError(f"sequence {seq_id} shares KV pages with a fork: not exported, its KV now lost")
    return slots


def _logical_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page holding each `page_size` positions of a sequence, checking that each lies whole,
    in order, in one page (true of every block: only a sequence's last page is partial)."""
    pages = slots[::page_size] // page_size
    offsets = np.arange(len(slots)) % page_size
    if not np.array_equal(slots, np.repeat(pages, page_size)[: len(slots)] * page_size + offsets):
        raise RuntimeError("a sequence's KV slots are not whole pages in order")
    return pages


def _runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(logical page, physical page, count) for each run of consecutive physical pages."""
    if not len(pages):
        return []
    cuts = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(pages)]])
    return [(int(a), int(pages[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def _cache_layout_hash(kv) -> str | None:
    """TVM's hash of the cache's layout (heads, dims, dtype, RoPE, layer kinds), or None where TVM
    gives none (sliding-window layers)."""
    try:
        return str(_layout_hash(kv))
    except Exception:
        return None


def export_sequence(kv, seq_id: int) -> tuple[str, list[np.ndarray]]:
    """Any sequence's KV: metadata (JSON) and one array per layer, (1, pages, 2, kv_heads,
    page_size, head_dim), as TVM's checkpoint lays them out (the last page's unused slots zero).
    Leaves the cache as it was; needs one free page while it runs. For a cache with
    sliding-window layers (Gemma 3) it finds the pages by a pop and re-reservation, which a
    sequence sharing blocks with a fork does not survive (KVPool never forks)."""
    length = int(_sequence_length(kv, seq_id))
    pages, kinds = _page_tensors(kv)
    _, two, heads, page_size, dim = pages[0].shape
    if not length:
        slots = np.zeros(0, np.int64)
    elif all(k == "mha" for k in kinds):
        slots = _slots_by_debug_get_kv(kv, seq_id, length, pages)
    else:
        slots = _slots_by_round_trip(kv, seq_id, length, page_size)
    logical = _logical_pages(slots, page_size)
    groups = []
    for layer in pages:
        out = np.empty((1, len(logical), two, heads, page_size, dim), layer.dtype)
        for at, page, count in _runs(logical):
            out[0, at : at + count] = layer[page : page + count]
        out[0, length // page_size :, :, :, length % page_size :] = 0  # a partial last page's rest
        groups.append(out)
    dtype, count = str(pages[0].dtype), len(logical)
    meta = {
        "format_version": 1,
        "cache_type": "relax.vm.PagedAttentionKVCache",
        "exported_by": "goinfer export_sequence",
        "layout_hash": _cache_layout_hash(kv),
        "page_size": page_size,
        "num_layers": len(pages),
        "layer_begin": 0,
        "layer_end": len(pages),
        "num_kv_heads": heads,
        "qk_head_dim": dim,
        "v_head_dim": dim,
        "dtype": dtype,
        "attn_kinds": list(kinds),
        "page_group_layout": _GROUP_LAYOUT,
        "seq_id": seq_id,
        "seq_length": length,
        "logical_pages": [
            {"logical_page_index": i, "start_pos": start, "length": min(page_size, length - start)}
            for i, start in enumerate(range(0, length, page_size))
        ],
        "groups": [
            {
                "group_index": i,
                "layer_begin": i,
                "layer_end": i + 1,
                "num_logical_pages": count,
                "dtype": dtype,
                "shape": list(g.shape),
                "nbytes": int(g.nbytes),
            }
            for i, g in enumerate(groups)
        ],
    }
    return json.dumps(meta), groups


def checkpoint_layers(meta: dict, groups: list, layout: dict) -> list[np.ndarray]:
    """Each layer's saved pages, (pages, 2, kv_heads, page_size, head_dim), once every size the
    metadata and the arrays name is `layout`'s: a crafted file never steers a copy. `layout` has
    page_size, num_kv_heads, qk_head_dim, dtype and num_layers, and attn_kinds and layout_hash
    where the caller knows them (the cache does; a model's spec does not). ValueError says what
    differs."""
    page_size, heads, dim = layout["page_size"], layout["num_kv_heads"], layout["qk_head_dim"]
    length = meta["seq_length"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"KV export seq_length is {length!r}")
    count = -(-length // page_size)
    if "layout_hash" in layout and meta.get("layout_hash") != layout["layout_hash"]:
        raise ValueError("KV export is of another cache layout (layout_hash)")
    for key, want in layout.items():
        if key != "layout_hash" and key in meta and meta[key] != want:  # TVM hashes no sliding-window layout
            raise ValueError(f"KV export {key} is {meta[key]!r}, this cache's {want!r}")
    described = meta["groups"]
    if not isinstance(described, list) or len(described) != len(groups):
        raise ValueError("KV export's groups do not match its arrays")
    layers: list[np.ndarray] = []
    for g, data in zip(described, groups, strict=True):
        begin, end = g["layer_begin"], g["layer_end"]
        data = np.asarray(data)
        if begin != len(layers) or not isinstance(end, int) or end <= begin:
            raise ValueError("KV export's groups do not cover the layers in order")
        if data.shape != (end - begin, count, 2, heads, page_size, dim) or str(data.dtype) != layout["dtype"]:
            raise ValueError(f"KV export group {g.get('group_index')!r} is not this cache's layout")
        layers.extend(data)
    if len(layers) != layout["num_layers"]:
        raise ValueError(f"KV export has {len(layers)} layers, this cache {layout['num_layers']}")
    return layers


# Larger imports copy their layers on THREADS threads. A fresh cache's memory is mapped as it is
# first written, and two threads take those faults faster: 16 sessions of 4k tokens on the 1.5B
# (1.8 GB) into a new cache in 0.54 s against 0.88 s on one (Intel Xeon, 2 threads); on pages already
# written one thread is faster (0.36 s against 0.55 s), but a restore writes into a new cache.
_PARALLEL_COPY_BYTES = 16 << 20


def _copy_in(pages: list[np.ndarray], sources: list[np.ndarray], runs: list[tuple[int, int, int]]) -> None:
    def copy(layer: int) -> None:
        for at, page, count in runs:
            pages[layer][page : page + count] = sources[layer][at : at + count]

    if THREADS < 2 or sum(s.nbytes for s in sources) < _PARALLEL_COPY_BYTES:
        for layer in range(len(pages)):
            copy(layer)
        return
    from concurrent.futures import ThreadPoolExecutor  # numpy's copies release the GIL

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(copy, range(len(pages))))


def import_sequence(kv, seq_id: int, metadata: str, groups: list[np.ndarray]) -> None:
    """A new sequence `seq_id` holding an export's KV (export_sequence's, or TVM's checkpoint of
    sequence 0); every other sequence stays as it was. The pages are reserved as an append of the
    saved length would reserve them, one block, and the saved bytes copied in: a step on it is
    bit for bit a step on the sequence exported. Raises, the cache unchanged, where the export is
    not of this cache's layout or the cache is short of pages."""
    pages, kinds = _page_tensors(kv)
    try:
        meta = json.loads(metadata)
        _, _, heads, page_size, dim = pages[0].shape
        layout = {
            "page_size": page_size,
            "num_kv_heads": heads,
            "qk_head_dim": dim,
            "dtype": str(pages[0].dtype),
            "num_layers": len(pages),
            "attn_kinds": list(kinds),
            "layout_hash": _cache_layout_hash(kv),
        }
        sources = checkpoint_layers(meta, groups, layout)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"KV export metadata is malformed ({e!r})") from e
    page_size, length = pages[0].shape[3], meta["seq_length"]
    need, free = -(-length // page_size), available_pages(kv)
    if free < need:
        raise ValueError(f"the KV cache has {free} free pages, the import needs {need}")
    _add_sequence(kv, seq_id)
    try:
        if length:
            _copy_in(pages, sources, _runs(_logical_pages(_reserve(kv, seq_id, length), page_size)))
    except BaseException:
        _remove_sequence(kv, seq_id)
        raise


def to_numpy(t) -> np.ndarray:
    """A copy: the VM's pool hands the same memory to a later call."""
    return np.from_dlpack(t).copy()


def load_kernels(library_path: str):
    """A library of standalone kernels, each callable by name (the self-test fixtures)."""
    return tvm_ffi.load_module(library_path)


def run_kernel(lib, name: str, inputs: list[np.ndarray], out_like: np.ndarray) -> np.ndarray:
    """Call one destination-passing kernel on copies of `inputs`; returns its output."""
    args = [tensor(a) for a in inputs]
    out = _aligned_copy(np.zeros_like(out_like), out_like.dtype)
    lib[name](*args, tvm_ffi.from_dlpack(out))
    return out
