"""Lower a model to a compiled library, or reuse the one compiled before for the same graph.

The cache key is everything the compiled code depends on: the spec, the scheme of every weight,
the KV cache's dtype, the target, the TVM version and the source that generates code
(fingerprint.codegen_fingerprint).
A hit skips export and compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from goinfer.artifacts import cache

from ..fingerprint import codegen_fingerprint
from ..spec import ModelSpec
from . import schedules, tvm_api


@dataclass(frozen=True)
class Compiled:
    library: bytes  # the shared library TVM loads
    param_names: list[str]  # the order the entry points take their parameters in
    target: dict[str, Any]
    from_cache: bool


def cache_dir() -> Path:
    return cache.folder("modules")


def tiers_for(name: str, num_cores: int | None) -> list[tuple[str, dict[str, Any]]]:
    """(tier, target) to compile for, best first (see tvm_api.cpu_tiers)."""
    if name != "llvm":
        raise ValueError(f"target {name!r} is not built yet")
    return tvm_api.cpu_tiers(num_cores)


class Exportable(Protocol):
    kv_dtype: str  # the KV cache's dtype, which the exported module is built for

    def exported(self) -> tuple[Any, list[tuple[str, Any]]]:
        """The model's Relax module and its (name, parameter) list, as compiled."""
        ...


def compile_model(
    model: Exportable, spec: ModelSpec, schemes: dict[str, str], target: dict, progress: Callable[[str], None]
) -> Compiled:
    key_src = {
        "spec": spec.to_json(),
        "schemes": schemes,
        "kv_dtype": model.kv_dtype,
        "target": target,
        "tvm": tvm_api.TVM_VERSION,
        "code": codegen_fingerprint(),
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:32]
    entry = cache_dir() / key
    lib, names = entry / "module.so", entry / "params.json"
    if lib.is_file() and names.is_file():
        progress(f"      reusing compiled module {key}")
        return Compiled(lib.read_bytes(), json.loads(names.read_text()), target, True)

    t0 = time.perf_counter()
    mod, params = model.exported()
    progress(
        f"      exported {len(mod.functions_items())} functions in {time.perf_counter() - t0:.1f}s; compiling"
    )
    executable = tvm_api.compile_module(mod, tvm_api.make_target(target), schedules.cpu_rules())
    entry.mkdir(parents=True, exist_ok=True)
    # Written to a temp name then renamed, so a crash never leaves a half library in the cache.
    with tempfile.TemporaryDirectory(dir=entry) as tmp:
        tmp_lib = Path(tmp) / "module.so"
        tvm_api.export_library(executable, str(tmp_lib))
        (Path(tmp) / "params.json").write_text(json.dumps([n for n, _ in params]))
        os.replace(Path(tmp) / "params.json", names)
        os.replace(tmp_lib, lib)
    progress(f"      compiled in {time.perf_counter() - t0:.1f}s")
    return Compiled(lib.read_bytes(), [n for n, _ in params], target, False)
