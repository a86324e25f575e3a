"""`goinfer build`: checkpoint -> quantized, compiled, packed .giw bundle, in numbered steps."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from goinfer.artifacts import giw, manifest

from . import __version__
from .kernels.paging import DEFAULT_KV_DTYPE, PAGE_SIZE  # the attention kernels' page (no TVM imported)
from .sources import load_checkpoint
from .sources.base import Checkpoint, SourceTensor

Progress = Callable[[str], None]

TARGETS = ("llvm",)  # cuda and metal lower through the same pipeline once their schedules exist
# The longest prefill chunk: the KV cache sizes its per-forward buffers from it, and a chunk's
# activations grow with it. Longer prompts run in several chunks.
MAX_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class BuildOptions:
    target: str = "llvm"
    quant: str = "gguf"  # the checkpoint's own blocks, value-exact (quant/gguf.py)
    num_cores: int | None = None  # threads the compiled module is built for; default: this host's
    kv_dtype: str = DEFAULT_KV_DTYPE  # the KV cache's pages: "float16" | "float32" (manifest.KV_DTYPES)


@dataclass(frozen=True)
class BuildResult:
    path: Path
    size: int
    sha256: str
    seconds: float
    compiled_from_cache: bool


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(
    source: str | Path,
    output: str | Path,
    options: BuildOptions = BuildOptions(),
    progress: Progress = _stderr,
) -> BuildResult:
    from . import selftest
    from .lower import compile_cache  # TVM is imported here, not at `import goinfer.compiler`
    from .models import FAMILIES, layer
    from .models.decoder import build_model
    from .quant import QUANT_MODES, scheme_for

    t0 = time.perf_counter()
    if options.target not in TARGETS:
        raise BuildError(f"unknown target {options.target!r}; choose one of {', '.join(TARGETS)}")
    if options.quant not in QUANT_MODES:
        raise BuildError(f"unknown quant {options.quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if options.kv_dtype not in manifest.KV_DTYPES:
        raise BuildError(
            f"unknown KV cache dtype {options.kv_dtype!r}; choose one of {', '.join(manifest.KV_DTYPES)}"
        )
    output = Path(output)
    _check_writable(output)

    # 1. Load: spec, tokenizer, template and lazily-dequantized tensors from the checkpoint.
    # (Nothing is printed before the input is known good, so bad input gets exactly one line.)
    ckpt = load_checkpoint(source)
    spec = ckpt.spec
    if spec.family not in FAMILIES:
        raise BuildError(f"unsupported architecture {spec.family!r}; supported: {', '.join(FAMILIES)}")
    progress(
        f"[1/5] read {source}: {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}, {len(ckpt.tensors)} tensors"
    )

    # 2. Model: the family's module, each weight with the scheme the quant mode picks for it.
    def pick(parts: Sequence[SourceTensor]) -> ModuleType:
        return scheme_for(options.quant, parts)

    progress(f"[2/5] building the {spec.family} graph ({options.quant}, KV cache {options.kv_dtype})")
    target = compile_cache.tiers_for(options.target, options.num_cores)[0][1]
    model = build_model(spec, layer(spec.family), pick, ckpt.tensors, target, options.kv_dtype)

    # 3. Quantize: pack every weight (pure numpy), checking each against the model's parameters.
    tensors, schemes = _pack_weights(model, ckpt, progress)

    # 4. Lower and compile for each CPU tier (the host's best ISA, then AVX2 to step down to),
    #    or reuse the modules compiled for the same graph; plus each tier's self-test kernels.
    tiers = compile_cache.tiers_for(options.target, options.num_cores)
    fixtures = selftest.fixtures(layouts=_layouts(model))
    compiled_tiers = []
    for i, (tier, tier_target) in enumerate(tiers):
        progress(
            f"[4/5] compiling for {options.target} tier {tier} "
            f"({tier_target['mcpu']}, {tier_target['num-cores']} cores)"
        )
        compiled = compile_cache.compile_model(model, spec, schemes, tier_target, progress)
        key = options.target if i == 0 else f"{options.target}@{tier}"
        compiled_tiers.append((tier, key, compiled, selftest.compile_for(fixtures, tier_target)))
    compiled = compiled_tiers[0][2]
    if any(c.param_names != compiled.param_names for _t, _k, c, _s in compiled_tiers):
        raise BuildError("internal: CPU tiers disagree on the parameter order")

    # 5. Pack: manifest + aligned, hashed blobs, written atomically.
    progress(f"[5/5] writing {output}")
    param_order = compiled.param_names
    missing = [n for n in param_order if n not in tensors]
    if missing:
        raise BuildError(f"internal: no packed weight for parameters {missing[:3]}")
    st_tensors, st_cases = selftest.tensors_and_manifest(fixtures)
    cpu_tiers = [
        manifest.CpuTier(tier=tier, module=key, selftest=f"selftest@{tier}", target=c.target)
        for tier, key, c, _st in compiled_tiers
    ]
    contract = _manifest(ckpt, options, schemes, param_order, cpu_tiers, st_cases)
    modules = []
    for tier, key, c, st in compiled_tiers:
        modules += [(key, c.target, c.library), (f"selftest@{tier}", c.target, st)]
    info = giw.write_bundle(
        output,
        contract.to_json(),
        [*((name, tensors[name]) for name in param_order), *st_tensors, _tokenizer_tensor(ckpt)],
        modules,
    )
    seconds = time.perf_counter() - t0
    progress(
        f"built {output} ({info.size / 2**20:.1f} MiB, {spec.family}, {options.quant}, {options.target}) "
        f"in {seconds:.1f}s{' (module from cache)' if compiled.from_cache else ''}"
    )
    return BuildResult(output, info.size, info.sha256, seconds, compiled.from_cache)


def _layouts(model) -> tuple:
    """The grouped affine layouts the model's weights use: each is a self-test fixture."""
    from .lower import tvm_api
    from .models.layers import QLinear

    found = {getattr(m.scheme, "layout", None) for _p, m in tvm_api.modules_of_type(model, QLinear)}
    return tuple(sorted((lay for lay in found if lay is not None), key=lambda lay: lay.tag))


class BuildError(ValueError):
    """A build that cannot go ahead: the message says why, in one line."""


def _check_writable(output: Path) -> None:
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise BuildError(f"cannot write {output}: directory {parent} does not exist")
    if output.is_dir():
        raise BuildError(f"cannot write {output}: it is a directory")
    probe = parent / f".{output.name}.probe"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise BuildError(f"cannot write {output}: {e.strerror}") from None


def _pack_weights(
    model, ckpt: Checkpoint, progress: Progress
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from .lower import tvm_api
    from .models.layers import Weighted

    weighted = tvm_api.modules_of_type(model, Weighted)
    used: set[str] = set()
    tensors: dict[str, np.ndarray] = {}
    schemes: dict[str, str] = {}
    for i, (prefix, module) in enumerate(weighted, 1):
        packed = module.pack(ckpt.tensors)
        for key, arr in packed.items():
            declared = getattr(module, key)
            if tuple(arr.shape) != tuple(int(x) for x in declared.shape) or str(arr.dtype) != declared.dtype:
                raise BuildError(
                    f"{prefix}.{key}: packed {arr.dtype}{list(arr.shape)}, "
                    f"model declares {declared.dtype}{list(declared.shape)}"
                )
            tensors[f"{prefix}.{key}"] = arr
        scheme = getattr(module, "scheme", None)
        schemes[prefix] = scheme.NAME if scheme is not None else "f32"
        used.update(module.sources)
        if i % 16 == 0 or i == len(weighted):
            progress(f"[3/5] quantized {i}/{len(weighted)} weights")
    kinds = Counter(schemes[prefix] for prefix, module in weighted if hasattr(module, "scheme"))
    progress("      schemes: " + ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())))
    unused = sorted(set(ckpt.tensors) - used)
    if unused:
        progress(f"      note: {len(unused)} checkpoint tensors unused: {', '.join(unused[:4])}")
    return tensors, schemes


# The tokenizers JSON is a byte tensor, not a manifest string: every open parses and hashes the
# manifest, and a 5 MB string in it (Qwen's 151k-token vocabulary) cost ~40 ms of a cold start.
TOKENIZER_TENSOR = "tokenizer.json"


def _tokenizer_tensor(ckpt: Checkpoint) -> tuple[str, np.ndarray]:
    return TOKENIZER_TENSOR, np.frombuffer(ckpt.tokenizer_json.encode("utf-8"), np.uint8)


def kv_cache(spec: manifest.ModelSpec, dtype: str = DEFAULT_KV_DTYPE) -> manifest.KVCache:
    """The cache's layout and the prefill chunk: the runtime creates the cache for this chunk and
    cuts every prompt to it, so a prompt of any length up to the window fits."""
    # Windowed layers are exact only when a chunk is shorter than the window: TVM's ragged prefill
    # kernel applies no window within a chunk.
    limit = spec.sliding_window - 1 if spec.sliding_window else spec.context_length
    chunk = max(1, min(MAX_PREFILL_CHUNK, limit))
    return manifest.KVCache(page_size=PAGE_SIZE, prefill_chunk=chunk, dtype=dtype)


def _manifest(
    ckpt: Checkpoint,
    options: BuildOptions,
    schemes: dict[str, str],
    param_order: list[str],
    cpu_tiers: list[manifest.CpuTier],
    selftest: manifest.SelfTest,
) -> manifest.Manifest:
    import tvm

    return manifest.Manifest(
        goinfer_version=__version__,
        tvm_version=tvm.__version__,
        model=ckpt.spec,
        tokens=ckpt.tokens,
        tokenizer_tensor=TOKENIZER_TENSOR,
        chat_template=ckpt.chat_template,
        chat_template_origin=ckpt.chat_template_origin,
        params=tuple(param_order),
        weight_schemes=schemes,
        kv_cache=kv_cache(ckpt.spec, options.kv_dtype),
        entry_points=manifest.ENTRY_POINTS,
        cpu_tiers=tuple(cpu_tiers),
        selftest=selftest,
        source=manifest.Source(ref=Path(ckpt.source).name, sha256=ckpt.sha256),
        build=manifest.Build(target=options.target, quant=options.quant),
    )
