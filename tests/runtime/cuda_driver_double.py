"""A TEST DOUBLE of the NVIDIA driver (libcuda.so.1), for machines without a GPU.

It reports one device (sm_90, 141 GiB) and answers every other call with
CUDA_ERROR_NOT_SUPPORTED, so the runtime's CUDA load path (probe, libcudart, TVM's CUDA runtime)
runs for real up to the first device allocation, which then fails with a clean error. It exports
every `cu*` symbol libtvm_runtime_cuda.so links against (read from the library at build time, so a
TVM upgrade that needs a new one still loads), plus the ones the probe and libcudart look up.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

NAME = "goinfer stand-in GPU (test double)"
TOTAL_MEMORY = 141 * 2**30
NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED

# Looked up by name rather than linked (the probe's via ctypes, libcudart's via dlsym); each is
# defined in _SPECIAL below.
LOOKED_UP = (
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuGetExportTable",
)

# The calls that answer something other than NOT_SUPPORTED, with their real signatures.
_SPECIAL = rf"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

int cuInit(unsigned int flags) {{ return 0; }}
int cuDriverGetVersion(int *v) {{ *v = 13000; return 0; }}
int cuDeviceGetCount(int *n) {{ *n = 1; return 0; }}
int cuDeviceGet(int *dev, int ordinal) {{ if (ordinal != 0) return 101; *dev = 0; return 0; }}
int cuDeviceGetName(char *name, int len, int dev) {{
    if (len <= 0) return 1;
    strncpy(name, "{NAME}", (size_t)len - 1);
    name[len - 1] = 0;
    return 0;
}}
int cuDeviceGetAttribute(int *value, int attribute, int dev) {{
    *value = attribute == 75 ? 9 : 0;  /* compute capability major 9, minor (76) 0 */
    return 0;
}}
int cuDeviceTotalMem_v2(size_t *bytes, int dev) {{ *bytes = {TOTAL_MEMORY}ULL; return 0; }}

static const char *error_name(int e) {{
    switch (e) {{
    case 0: return "CUDA_SUCCESS";
    case 1: return "CUDA_ERROR_INVALID_VALUE";
    case 101: return "CUDA_ERROR_INVALID_DEVICE";
    case 500: return "CUDA_ERROR_NOT_FOUND";
    case {NOT_SUPPORTED}: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return 0;
    }}
}}
int cuGetErrorName(int e, const char **s) {{ *s = error_name(e); return *s ? 0 : 1; }}
int cuGetErrorString(int e, const char **s) {{
    *s = e == {NOT_SUPPORTED} ? "operation not supported (goinfer's driver test double)" : error_name(e);
    return *s ? 0 : 1;
}}

/* libcudart fetches its driver entry points here: finding none, it reports an unusable driver at
   its first API call instead of calling into a table it does not have. */
int cuGetProcAddress(const char *symbol, void **fn, int version, uint64_t flags) {{
    *fn = 0;
    return 500;
}}
int cuGetProcAddress_v2(const char *symbol, void **fn, int version, uint64_t flags, int *status) {{
    *fn = 0;
    if (status) *status = 1;  /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;
}}
int cuGetExportTable(const void **table, const void *id) {{ *table = 0; return {NOT_SUPPORTED}; }}
"""


def _tvm_cuda_library() -> Path:
    spec = importlib.util.find_spec("tvm")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtvm_runtime_cuda.so"


def _linked_driver_symbols(library: Path) -> set[str]:
    """The driver symbols `library` needs from libcuda (cu*, not libcudart's cuda*)."""
    out = subprocess.run(
        ["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith("cu") and not n.startswith("cuda")}


def build(tmpdir: Path) -> Path:
    """Compile the double into `tmpdir`/libcuda.so.1 (and a libcuda.so link); returns the path.
    Skips the calling test where there is no C compiler, nm, or TVM CUDA runtime to stand in for."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("nm") is None:
        pytest.skip("the driver test double needs a C compiler (cc) and nm")
    tvm_cuda = _tvm_cuda_library()
    if not tvm_cuda.exists():
        pytest.skip(f"this TVM has no CUDA runtime ({tvm_cuda.name})")
    others = sorted(_linked_driver_symbols(tvm_cuda) - set(LOOKED_UP))
    source = _SPECIAL + "".join(f"int {n}(void) {{ return {NOT_SUPPORTED}; }}\n" for n in others)
    tmpdir = Path(tmpdir)
    (tmpdir / "cuda_driver_double.c").write_text(source)
    lib = tmpdir / "libcuda.so.1"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-w",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(lib),
            str(tmpdir / "cuda_driver_double.c"),
        ],
        check=True,
        capture_output=True,
    )
    link = tmpdir / "libcuda.so"
    if not link.exists():
        link.symlink_to(lib.name)
    return lib
