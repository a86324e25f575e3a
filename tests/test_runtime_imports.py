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
        "vm_builtin": rt._reshape is not None,
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


def test_unknown_type_keys_are_answered_without_a_lookup_error() -> None:
    from goinfer.runtime import tvm_runtime  # noqa: F401 - installs the guard
    from tvm_ffi import core

    assert core._object_type_key_to_index("goinfer.NoSuchType") is None
    assert core._object_type_key_to_index("ffi.Tensor") is not None
