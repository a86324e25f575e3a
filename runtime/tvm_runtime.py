"""The runtime's only door to TVM: its runtime library, never the compiler.

`TVM_USE_RUNTIME_LIB=1` makes `import tvm` load just libtvm_runtime (0.36 s instead of ~1.3 s,
DESIGN.md §4). It only applies if nothing imported the full TVM first (a build in the same
process does; then the full library is already there and serves the runtime just as well).
"""

from __future__ import annotations

import os
import sys

if "tvm" not in sys.modules:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

import numpy as np
import tvm
from tvm.runtime import vm as _vm
from tvm_ffi import Shape

_reshape = tvm.get_global_func("vm.builtin.reshape")
_add_sequence = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
_remove_sequence = tvm.get_global_func("vm.builtin.kv_state_remove_sequence")
_begin_forward = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
_end_forward = tvm.get_global_func("vm.builtin.kv_state_end_forward")
_popn = tvm.get_global_func("vm.builtin.kv_state_popn")

CPU = tvm.cpu()


def load_vm(library_path: str) -> _vm.VirtualMachine:
    return _vm.VirtualMachine(tvm.runtime.load_module(library_path), CPU)


def wrap(array: np.ndarray):
    """A TVM tensor over the same memory (DLPack, no copy). `array` must be writable."""
    return tvm.runtime.from_dlpack(array)


def data_pointer(t) -> int:
    """The address of a TVM tensor's first byte (tests use it to prove zero-copy)."""
    return int(np.from_dlpack(t).ctypes.data)


def int32_tensor(values) -> object:
    return tvm.runtime.tensor(np.asarray(values, dtype=np.int32), CPU)


def reshape(t, shape: tuple[int, ...]):
    return _reshape(t, Shape(list(shape)))


def create_kv_cache(vm, max_batch: int, max_total: int, prefill_chunk: int, page_size: int):
    return vm["create_kv_cache"](
        Shape([max_batch]), Shape([max_total]), Shape([prefill_chunk]), Shape([page_size])
    )


def add_sequence(kv, seq_id: int) -> None:
    _add_sequence(kv, seq_id)


def remove_sequence(kv, seq_id: int) -> None:
    _remove_sequence(kv, seq_id)


def begin_forward(kv, seq_ids: list[int], lengths: list[int]) -> None:
    _begin_forward(kv, Shape(seq_ids), Shape(lengths))


def end_forward(kv) -> None:
    _end_forward(kv)


def pop_tokens(kv, seq_id: int, n: int) -> None:
    _popn(kv, seq_id, n)


def to_numpy(t) -> np.ndarray:
    return t.numpy()


def load_kernels(library_path: str):
    """A library of standalone kernels, each callable by name (the self-test fixtures)."""
    return tvm.runtime.load_module(library_path)


def run_kernel(lib, name: str, inputs: list[np.ndarray], out_like: np.ndarray) -> np.ndarray:
    """Call one destination-passing kernel on copies of `inputs`; returns its output."""
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), CPU) for a in inputs]
    out = tvm.runtime.tensor(np.zeros_like(out_like), CPU)
    lib[name](*args, out)
    return out.numpy()
