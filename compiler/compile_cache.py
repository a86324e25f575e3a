"""Lower a model to a compiled library, or reuse the one compiled before for the same graph.

The cache key is everything the compiled code depends on: the spec, the scheme of every weight,
the graph's variant (a decoder's KV cache dtype, an encoder's pooling), the target, the TVM
version and the source that generates code (fingerprint.codegen_fingerprint).
`lookup` asks first (a hit needs no export); on a miss the build exports the graph and
`compile_model` compiles it.
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
from typing import Any

from goinfer.artifacts import cache
from goinfer.artifacts.manifest import ModelSpec

from .fingerprint import codegen_fingerprint
from .tvm import export, schedules, targets


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
    name: str, num_cores: int | None, cuda_arch: str = targets.DEFAULT_CUDA_ARCH
) -> list[tuple[str, dict[str, Any]]]:
    """(tier, target) to compile for, best first: the CPU's ISA tiers (see targets.cpu_tiers), a
    CUDA arch ("sm_90"), or Metal."""
    if name == "llvm":
        return targets.cpu_tiers(num_cores)
    if name == "cuda":
        return [(cuda_arch, targets.cuda_target(cuda_arch, num_cores))]
    if name == "metal":
        return [("metal", targets.metal_target())]
    raise ValueError(f"unknown target {name!r}")


Graph = tuple[Any, list[tuple[str, Any]]]  # an exported Relax module and its (name, parameter) list


def _key(variant: str, spec: ModelSpec, schemes: dict[str, str], target: dict) -> str:
    key_src = {
        "spec": spec.to_json(),
        "schemes": schemes,
        "variant": variant,
        "target": target,
        "tvm": targets.TVM_VERSION,
        "code": codegen_fingerprint(),
    }
    return hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:32]


def _files(entry: Path, target: dict) -> tuple[Path, Path, Path, Path]:
    # Metal's host code is arm64 Mach-O, linked where it loads: its objects travel as a tar.
    lib = entry / ("module.tar" if target["kind"] == "metal" else "module.so")
    return lib, entry / "params.json", entry / "kernels.bin", entry / "kernels.json"


def lookup(
    variant: str,
    spec: ModelSpec,
    schemes: dict[str, str],
    target: dict,
    progress: Callable[[str], None] | None = None,
) -> Compiled | None:
    """The module compiled before for this graph and target, or None: no export, no compile."""
    key = _key(variant, spec, schemes, target)
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
    graph: Graph,
    variant: str,
    spec: ModelSpec,
    schemes: dict[str, str],
    target: dict,
    progress: Callable[[str], None],
) -> Compiled:
    """`graph` (exported for `target`'s kind) compiled for `target`, and cached. Several targets
    may compile at once on threads: TVM's passes and LLVM release the GIL."""
    key = _key(variant, spec, schemes, target)
    entry = cache_dir() / key
    lib, names, kernels, kernels_meta = _files(entry, target)
    gpu_kernels = target["kind"] == "cuda"

    t0 = time.perf_counter()
    tvm_target = targets.make_target(target)
    mod, params = graph
    executable = export.compile_module(mod, tvm_target, schedules.rules_for(target["kind"]))
    entry.mkdir(parents=True, exist_ok=True)
    # Written to a temp name then renamed, so a crash never leaves a half library in the cache.
    binary, sha = b"", ""
    if gpu_kernels:
        source = targets.cuda_source(executable)
        binary, sha = (
            targets.compile_cuda_source(source, tvm_target),
            hashlib.sha256(source.encode()).hexdigest(),
        )
    with tempfile.TemporaryDirectory(dir=entry) as tmp:
        tmp_lib = Path(tmp) / lib.name
        export.export_library(executable, str(tmp_lib))
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
