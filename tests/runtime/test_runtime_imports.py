"""What a cold start loads: the runtime reaches TVM through its runtime library alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import json, sys
    import goinfer.runtime.model
    from goinfer.runtime import tvm_runtime as rt
    print(json.dumps({
        "modules": sorted(m for m in sys.modules if m == "tvm" or m.startswith(("tvm.", "goinfer."))),
        "lazy": sorted(m for m in ("jinja2", "llguidance") if m in sys.modules),
        "vm_builtin": rt._begin_forward is not None,
    }))
    """
)


def test_runtime_loads_neither_the_tvm_package_nor_the_compiler() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vm_builtin"]
    assert not [m for m in got["modules"] if m == "tvm" or m.startswith("tvm.")], got["modules"]
    assert not [m for m in got["modules"] if m.startswith("goinfer.compiler")], got["modules"]
    # chat templates and grammars load on first use: ~100 ms a raw-text cold start does not pay
    assert got["lazy"] == [], got["lazy"]


_MISS_PROBE = textwrap.dedent(
    """
    import json
    from tvm_ffi import core
    real, seen = core._object_type_key_to_index, []
    def counting(key):
        seen.append(key)
        return real(key)
    core._object_type_key_to_index = counting  # what the runtime's guard will wrap
    from goinfer.runtime import tvm_runtime
    seen.clear()
    miss = core._object_type_key_to_index("goinfer.NoSuchType")
    hit = core._object_type_key_to_index("ffi.Tensor")
    print(json.dumps({"miss": miss, "hit": hit, "seen": seen}))
    """
)


def test_unknown_type_keys_never_reach_the_native_lookup() -> None:
    """A miss in the native lookup builds a C++ backtrace (0.4 s the first time): the guard must
    answer it from the key list, and pass known keys through."""
    out = subprocess.run([sys.executable, "-c", _MISS_PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["miss"] is None and isinstance(got["hit"], int)
    assert got["seen"] == ["ffi.Tensor"], got["seen"]
