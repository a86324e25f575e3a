"""The runtime's CPU door to TVM: libtvm_runtime through tvm_ffi, never the compiler.

A cold start pays for every import, so this module does not `import tvm` (its Python package costs
~0.15 s on top of the library here, measured). It loads libtvm_runtime itself, next to tvm_ffi, and
drives the Relax VM through the packed functions the library registers. It is not the only one:
cuda.py (the CUDA door) loads TVM's CUDA runtime beside it and calls tvm_ffi itself, and model.py,
kv_pool.py, selftest.py and gpu_selftest.py call through this module; none of them imports the tvm
package. A compiler in the same process (a build, the tests) imports tvm as usual; both then share
the one loaded runtime library.
"""

from __future__ import annotations

import functools
import importlib.util
import json
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


def _aligned_copy(values, dtype) -> np.ndarray:
    src = np.asarray(values, dtype=dtype)
    raw = np.empty(src.nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = raw[start : start + src.nbytes].view(src.dtype).reshape(src.shape)
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


# TVM's KV checkpoint works on sequence 0 only, and importing one empties the whole cache.
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
