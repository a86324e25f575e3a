"""The runtime's CUDA door: is a GPU usable here, loading TVM's CUDA runtime, device tensors.

Like tvm_runtime, this never imports `tvm`: it loads libtvm_runtime_cuda.so next to libtvm_runtime
and calls the packed functions it registers. That library links against the driver (libcuda.so.1)
and libcudart.so.13, so it cannot even load on a machine without an NVIDIA driver; `probe()` asks
the driver directly (ctypes) so a report can say why, and `enable()` turns every load failure into
one CudaUnavailable line.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm_ffi

_DRIVER = "libcuda.so.1"
_CUDART = "libcudart.so.13"
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
_NO_DRIVER = f"no NVIDIA driver: {_DRIVER} not found"
_NO_CUDART = f"{_CUDART} not found: pip install 'goinfer[cuda]'"


class CudaUnavailable(RuntimeError):
    """CUDA cannot be used in this process; the message is one line saying why."""


class CudaError(RuntimeError):
    """A CUDA operation (allocation, copy) failed; the message is one line."""


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int  # bytes


@dataclass(frozen=True)
class Probe:
    usable: bool
    reason: str  # why not; "" when usable
    devices: tuple[GpuDevice, ...]
    driver_version: str  # "13.0", or "" when no driver answered
    runtime_version: str  # libcudart's, or "" when it is missing

    def arch(self, index: int = 0) -> str:
        major, minor = self.devices[index].compute_capability
        return f"sm_{major}{minor}"

    def to_json(self) -> dict:
        return {
            "usable": self.usable,
            "reason": self.reason,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "compute_capability": list(d.compute_capability),
                    "arch": self.arch(i),
                    "total_memory": d.total_memory,
                }
                for i, d in enumerate(self.devices)
            ],
            "driver_version": self.driver_version,
            "runtime_version": self.runtime_version,
        }


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # CUDA encodes 13.5 as 13050


def _tvm_lib_dir() -> Path | None:
    from .tvm_runtime import tvm_lib_dir  # (importing it loads libtvm_runtime, which we need anyway)

    return tvm_lib_dir()


def _cudart_candidates() -> list[str]:
    """The pip package's libcudart first (what goinfer[cuda] installs), then the system loader's."""
    spec = importlib.util.find_spec("nvidia")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    found = [str(Path(d) / "cu13" / "lib" / _CUDART) for d in dirs]
    return [p for p in found if Path(p).exists()] + [_CUDART]


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    # RTLD_GLOBAL: libtvm_runtime_cuda.so then resolves its libcudart.so.13 to this one.
    for path in _cudart_candidates():
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _runtime_version() -> str:
    lib = _cudart()
    v = ctypes.c_int()
    if lib is None or lib.cudaRuntimeGetVersion(ctypes.byref(v)) != 0:
        return ""
    return _version(v.value)


def _error_name(driver: ctypes.CDLL, code: int) -> str:
    get_name = getattr(driver, "cuGetErrorName", None)
    name = ctypes.c_char_p()
    if get_name is None or get_name(code, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {code}"
    return f"{name.value.decode()} ({code})"


def _device(driver: ctypes.CDLL, index: int) -> GpuDevice:
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    name, total = ctypes.create_string_buffer(256), ctypes.c_size_t()
    for call in (
        lambda: driver.cuDeviceGet(ctypes.byref(dev), index),
        lambda: driver.cuDeviceGetName(name, len(name), dev),
        lambda: driver.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev),
        lambda: driver.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev),
        lambda: driver.cuDeviceTotalMem_v2(ctypes.byref(total), dev),
    ):
        code = call()
        if code != 0:
            raise OSError(f"cannot query cuda:{index}: {_error_name(driver, code)}")
    return GpuDevice(index, name.value.decode(errors="replace"), (major.value, minor.value), total.value)


def _probe_driver(driver: ctypes.CDLL) -> tuple[str, tuple[GpuDevice, ...], str]:
    """(reason, devices, driver version) from the driver itself."""
    code = driver.cuInit(0)
    if code != 0:
        return f"cuInit failed: {_error_name(driver, code)}", (), ""
    v, n = ctypes.c_int(), ctypes.c_int()
    driver_version = _version(v.value) if driver.cuDriverGetVersion(ctypes.byref(v)) == 0 else ""
    code = driver.cuDeviceGetCount(ctypes.byref(n))
    if code != 0:
        return f"cuDeviceGetCount failed: {_error_name(driver, code)}", (), driver_version
    if n.value == 0:
        return "the NVIDIA driver sees no GPU", (), driver_version
    try:
        return "", tuple(_device(driver, i) for i in range(n.value)), driver_version
    except OSError as e:
        return str(e), (), driver_version


@functools.cache
def probe() -> Probe:
    """What this machine's CUDA stack offers; never raises (cached: a process asks once)."""
    runtime_version = _runtime_version()
    try:
        driver = ctypes.CDLL(_DRIVER)
    except OSError:
        return Probe(False, _NO_DRIVER, (), "", runtime_version)
    try:
        reason, devices, driver_version = _probe_driver(driver)
    except (OSError, AttributeError) as e:  # a driver library missing an entry point
        reason, devices, driver_version = f"{_DRIVER} unusable: {e}", (), ""
    if not reason and not runtime_version:
        reason = _NO_CUDART
    lib_dir = _tvm_lib_dir()
    if not reason and (lib_dir is None or not (lib_dir / "libtvm_runtime_cuda.so").exists()):
        reason = "this TVM build has no CUDA runtime (libtvm_runtime_cuda.so)"
    return Probe(not reason, reason, devices, driver_version, runtime_version)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


_enabled = False


def enable() -> None:
    """Load TVM's CUDA runtime into this process (once); raises CudaUnavailable saying why not."""
    global _enabled
    if _enabled:
        return
    from . import tvm_runtime  # noqa: F401  (loads libtvm_runtime, which the CUDA library needs)

    if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is None:
        _load_cuda_runtime()
    if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is None:
        raise CudaUnavailable("TVM's CUDA runtime loaded but registered no device_api.cuda")
    _enabled = True


def _load_cuda_runtime() -> None:
    # Check the driver first: without it the TVM library's own load error names only a symbol.
    try:
        ctypes.CDLL(_DRIVER)
    except OSError:
        raise CudaUnavailable(_NO_DRIVER) from None
    if _cudart() is None:
        raise CudaUnavailable(_NO_CUDART)
    lib_dir = _tvm_lib_dir()
    path = lib_dir / "libtvm_runtime_cuda.so" if lib_dir else None
    if path is None or not path.exists():
        raise CudaUnavailable("this TVM build has no CUDA runtime (libtvm_runtime_cuda.so)")
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # global: compiled CUDA modules link to it
    except OSError as e:
        raise CudaUnavailable(f"cannot load TVM's CUDA runtime: {first_line(e)}") from None


@functools.cache
def _func(name: str):
    # Looked up once: upload and download run on every forward (token ids in, logits out).
    return tvm_ffi.get_global_func(name)


def _copy_bytes(name: str, tensor, array: np.ndarray, what: str) -> None:
    """TVM's byte copy `name` between a device tensor and a host array; CudaError naming `what`."""
    try:
        _func(name)(tensor, ctypes.c_void_p(array.ctypes.data), array.nbytes)
    except Exception as e:
        raise CudaError(f"CUDA: cannot copy {_mib(array.nbytes)} {what}: {first_line(e)}") from None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _dtype(dtype) -> tvm_ffi.dtype:
    return tvm_ffi.dtype(dtype if isinstance(dtype, str) else np.dtype(dtype).name)


def empty(shape, dtype, device_id: int = 0):
    """An uninitialised tensor on cuda:`device_id`; raises CudaError when it cannot be allocated."""
    enable()
    shape = tuple(int(d) for d in shape)
    t = _dtype(dtype)
    try:
        return _func("runtime.TVMTensorAllocWithScope")(
            tvm_ffi.Shape(list(shape)), t, tvm_ffi.device("cuda", device_id), None
        )
    except Exception as e:  # TVM raises RuntimeError; keep its first line (no backtrace)
        nbytes = int(np.prod(shape, dtype=np.int64)) * t.bits * t.lanes // 8
        raise CudaError(
            f"CUDA: cannot allocate {_mib(nbytes)} on cuda:{device_id}: {first_line(e)}"
        ) from None


def upload(array: np.ndarray, device_id: int = 0):
    """A new tensor on cuda:`device_id` holding a copy of `array`; raises CudaError on failure."""
    src = np.ascontiguousarray(array)  # the copy reads raw bytes
    out = empty(src.shape, src.dtype, device_id)
    _copy_bytes("runtime.TVMTensorCopyFromBytes", out, src, f"to cuda:{device_id}")
    return out


def _numpy_dtype(dtype) -> np.dtype:
    name = str(dtype)
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16, float8_*: numpy knows them through ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def download(tensor) -> np.ndarray:
    """A host numpy copy of a tensor on any device; raises CudaError when the copy fails."""
    if tensor.device.dlpack_device_type() == 1:  # kDLCPU: numpy reads it directly
        return np.from_dlpack(tensor).copy()
    out = np.empty(tuple(tensor.shape), _numpy_dtype(tensor.dtype))
    _copy_bytes("runtime.TVMTensorCopyToBytes", tensor, out, f"from {tensor.device}")
    return out


def serve_prebuilt_kernels(kernels: dict[str, bytes]) -> None:
    """Answer TVM's request to compile a module's CUDA source at load with the binary the build
    compiled from that source (by the source's sha256), so loading needs no CUDA compiler. A
    source with no prebuilt binary is an error naming its hash: the bundle and module disagree."""
    import hashlib

    def compiled(source: str) -> bytes:
        sha = hashlib.sha256(source.encode()).hexdigest()
        if sha not in kernels:
            raise RuntimeError(f"no prebuilt CUDA kernels for source {sha[:16]}: rebuild the bundle")
        return kernels[sha]

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compiled, override=True)
