"""Shared fixtures: tiny checkpoints written per session, bundles built once and cached.

Compiled modules are cached under the goinfer cache (keyed by the compiler's own source), so a
second run of the suite on the same machine skips TVM compilation entirely.
"""

from __future__ import annotations

import os

# Tests use the compiler and the runtime in one process: load the full TVM library, not the
# runtime-only one the runtime would otherwise ask for.
os.environ["TVM_USE_RUNTIME_LIB"] = "0"

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_gguf import rewrite_gguf, write_tiny_gguf


def _null(_msg: str) -> None:
    pass


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[tuple[str, str, int | None], Path] = {}

    def make(family: str, tensor_type: str = "F32", context: int | None = None) -> Path:
        """`context` replaces the tiny models' 256-token window (long-prompt tests).
        `tensor_type` "A+B:part" is a mixed file: type A, with the tensors whose names contain
        `part` stored as type B (Qwen's Q4_K_M keeps attn_v at Q8_0 beside Q5_0 q and k)."""
        key = (family, tensor_type, context)
        if key not in made:
            path = tmp_path_factory.mktemp("gguf") / f"tiny-{family}-{tensor_type}.gguf"
            if "+" in tensor_type:
                base, other = tensor_type.split("+")
                donor_type, part = other.split(":")
                donor = (make(family, donor_type), part)
                made[key] = rewrite_gguf(make(family, base), path, donor=donor)
            else:
                made[key] = write_tiny_gguf(path, family, seed=0, tensor_type=tensor_type)
            if context is not None:
                longer = path.with_name(f"tiny-{family}-{tensor_type}-ctx{context}.gguf")
                made[key] = rewrite_gguf(path, longer, set_keys={f"{family}.context_length": context})
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_bundle(
    tiny_gguf: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    from goinfer.compiler.build import BuildOptions, build

    made: dict[tuple[str, str, str, int | None, str], Path] = {}

    def make(
        family: str,
        quant: str = "f32",
        tensor_type: str = "F32",
        context: int | None = None,
        kv_dtype: str = "float32",
    ) -> Path:
        """`kv_dtype` is the KV cache's: float32 unless a test asks for float16 (the build's
        default), so that the runs tests compare with each other and with numpy stay exact."""
        key = (family, quant, tensor_type, context, kv_dtype)
        if key not in made:
            out = tmp_path_factory.mktemp("giw") / f"tiny-{family}-{quant}-{tensor_type}-{kv_dtype}.giw"
            source = tiny_gguf(family, tensor_type, context)
            options = BuildOptions(quant=quant, num_cores=2, kv_dtype=kv_dtype)
            build(source, out, options, progress=_null)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def real_gguf() -> Callable[[str], Path]:
    from goinfer.compiler.sources import zoo

    return lambda name: zoo.fetch(name)


@pytest.fixture(scope="session")
def real_bundle(real_gguf: Callable[[str], Path]) -> Callable[..., Path]:
    """A real model's bundle, built into the goinfer cache on first use and reused afterwards."""
    from goinfer.compiler.build import BuildOptions, build
    from goinfer.compiler.sources import zoo

    def make(name: str, quant: str = "gguf") -> Path:
        source = real_gguf(name)
        out = zoo.bundle_path(source, quant, "llvm")
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            build(source, out, BuildOptions(quant=quant, num_cores=2), progress=print)
        return out

    return make
