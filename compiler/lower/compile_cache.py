"""Lower a model to a compiled library, or reuse the one compiled before for the same graph.

The cache key is everything the compiled code depends on: the spec, the scheme of every weight,
the KV cache's dtype, the target, the TVM version and the source that generates code
(fingerprint.codegen_fingerprint).
A hit skips export and compile; `lookup` asks without compiling on a miss.
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
    # CUDA: the kernels compiled ahead of time (fatbin or cubin), and the sha256 of the source
    # they were compiled from, which is what the module asks to have compiled when it loads.
    kernels: bytes = b""
    kernels_source_sha256: str = ""


def cache_dir() -> Path:
    return cache.folder("modules")


def tiers_for(
    name: str, num_cores: int | None, cuda_arch: str = tvm_api.DEFAULT_CUDA_ARCH
) -> list[tuple[str, dict[str, Any]]]:
    """(tier, target) to compile for, best first: the CPU's ISA tiers (see tvm_api.cpu_tiers), a
    CUDA arch ("sm_90"), or Metal."""
    if name == "llvm":
        return tvm_api.cpu_tiers(num_cores)
    if name == "cuda":
        return [(cuda_arch, tvm_api.cuda_target(cuda_arch, num_cores))]
    if name == "metal":
        return [("metal", tvm_api.metal_target())]
    raise ValueError(f"unknown target {name!r}")


class Exportable(Protocol):
    kv_dtype: str  # the KV cache's dtype, which the exported module is built for

    def exported(self, target: Any = None) -> tuple[Any, list[tuple[str, Any]]]:
        """The model's Relax module for the target's kind and its (name, parameter) list."""
        ...


def _key(model: Exportable, spec: ModelSpec, schemes: dict[str, str], target: dict) -> str:
    key_src = {
        "spec": spec.to_json(),
        "schemes": schemes,
        "kv_dtype": model.kv_dtype,
        "target": target,
        "tvm": tvm_api.TVM_VERSION,
        "code": codegen_fingerprint(),
    }
    return hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:32]


def _files(entry: Path, target: dict) -> tuple[Path, Path, Path, Path]:
    # Metal's host code is arm64 Mach-O, linked where it loads: its objects travel as a tar.
    lib = entry / ("module.tar" if target["kind"] == "metal" else "module.so")
    return lib, entry / "params.json", entry / "kernels.bin", entry / "kernels.json"


def lookup(
    model: Exportable,
    spec: ModelSpec,
    schemes: dict[str, str],
    target: dict,
    progress: Callable[[str], None] | None = None,
) -> Compiled | None:
    """The module compiled before for this graph and target, or None: no export, no compile."""
    key = _key(model, spec, schemes, target)
    lib, names, kernels, kernels_meta = _files(cache_dir() / key, target)
    gpu_kernels = target["kind"] == "cuda"
    if not (lib.is_file() and names.is_file() and (not gpu_kernels or kernels_meta.is_file())):
        return None
    if progress is not None:
        progress(f"      reusing compiled module {key}")
    sha = json.loads(kernels_meta.read_text())["source_sha256"] if gpu_kernels else ""
    binary = kernels.read_bytes() if gpu_kernels else b""
    return Compiled(lib.read_bytes(), json.loads(names.read_text()), target, True, binary, sha)


def compile_model(
    model: Exportable, spec: ModelSpec, schemes: dict[str, str], target: dict, progress: Callable[[str], None]
) -> Compiled:
    """The module from the cache, or exported and compiled now (and cached). Several targets may
    compile at once on threads (TVM's passes and LLVM release the GIL), once the model has been
    exported for their kind (`model.exported`, which is not itself safe to race)."""
    found = lookup(model, spec, schemes, target, progress)
    if found is not None:
        return found
    key = _key(model, spec, schemes, target)
    entry = cache_dir() / key
    lib, names, kernels, kernels_meta = _files(entry, target)
    gpu_kernels = target["kind"] == "cuda"

    t0 = time.perf_counter()
    tvm_target = tvm_api.make_target(target)
    mod, params = model.exported(tvm_target)
    exported = time.perf_counter() - t0
    if exported >= 0.05:  # not already exported for another target
        progress(f"      exported {len(mod.functions_items())} functions in {exported:.1f}s; compiling")
    executable = tvm_api.compile_module(mod, tvm_target, schedules.rules_for(target["kind"]))
    entry.mkdir(parents=True, exist_ok=True)
    # Written to a temp name then renamed, so a crash never leaves a half library in the cache.
    binary, sha = b"", ""
    if gpu_kernels:
        source = tvm_api.cuda_source(executable)
        binary, sha = (
            tvm_api.compile_cuda_source(source, tvm_target),
            hashlib.sha256(source.encode()).hexdigest(),
        )
    with tempfile.TemporaryDirectory(dir=entry) as tmp:
        tmp_lib = Path(tmp) / lib.name
        tvm_api.export_library(executable, str(tmp_lib))
        (Path(tmp) / "params.json").write_text(json.dumps([n for n, _ in params]))
        if gpu_kernels:
            (Path(tmp) / "kernels.bin").write_bytes(binary)
            (Path(tmp) / "kernels.json").write_text(json.dumps({"source_sha256": sha}))
            os.replace(Path(tmp) / "kernels.bin", kernels)
            os.replace(Path(tmp) / "kernels.json", kernels_meta)
        os.replace(Path(tmp) / "params.json", names)
        os.replace(tmp_lib, lib)
    progress(f"      compiled {target.get('mcpu') or target['kind']} in {time.perf_counter() - t0:.1f}s")
    return Compiled(lib.read_bytes(), [n for n, _ in params], target, False, binary, sha)
