"""`goinfer build`: checkpoint -> quantized, compiled, packed .giw bundle, in numbered steps."""

from __future__ import annotations

import re
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

TARGETS = ("llvm", "cuda", "metal")
# The longest prefill chunk: the KV cache sizes its per-forward buffers from it, and a chunk's
# activations grow with it. Longer prompts run in several chunks.
MAX_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class BuildOptions:
    target: str = "llvm"  # one of TARGETS, or several comma-separated ("llvm,cuda"): one bundle
    quant: str = "gguf"  # the checkpoint's own blocks, value-exact (quant/gguf.py)
    num_cores: int | None = None  # threads the compiled module is built for; default: this host's
    kv_dtype: str = DEFAULT_KV_DTYPE  # the KV cache's pages: "float16" | "float32" (manifest.KV_DTYPES)
    cuda_arch: str = "sm_90"  # the CUDA compute capability compiled for (its PTX is embedded too)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target.split(",") if t.strip())


@dataclass(frozen=True)
class BuildResult:
    path: Path
    size: int
    sha256: str
    seconds: float
    compiled_from_cache: bool


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_output(source: str | Path, options: BuildOptions) -> Path:
    """Where a build without -o writes: beside a source file, else in the working directory, named
    for the model, quant and targets (model.gguf -> model.int4.cuda.giw)."""
    path = Path(str(source))
    if path.exists():  # a file: its stem, beside it
        folder, stem = path.parent, path.stem
    else:  # a zoo name or hf: reference, whose dots are not a suffix ("qwen2.5-coder-0.5b")
        folder, stem = Path("."), re.sub(r"[:/]", "-", str(source))
    return folder / f"{stem}.{options.quant}.{'+'.join(options.targets)}.giw"


def _check_options(options: BuildOptions) -> None:
    from .quant import QUANT_MODES

    targets = options.targets
    if not targets or (bad := [t for t in targets if t not in TARGETS]):
        given = bad[0] if targets else options.target
        raise BuildError(f"unknown target {given!r}; choose one or more of {', '.join(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise BuildError(f"target {options.target!r} names a target twice")
    if options.quant not in QUANT_MODES:
        raise BuildError(f"unknown quant {options.quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if options.kv_dtype not in manifest.KV_DTYPES:
        raise BuildError(
            f"unknown KV cache dtype {options.kv_dtype!r}; choose one of {', '.join(manifest.KV_DTYPES)}"
        )
    if "cuda" in targets and not re.fullmatch(r"sm_\d{2,3}a?", options.cuda_arch):
        raise BuildError(f"CUDA arch {options.cuda_arch!r} is not of the form sm_90")


def build(
    source: str | Path,
    output: str | Path | None = None,
    options: BuildOptions = BuildOptions(),
    progress: Progress = _stderr,
) -> BuildResult:
    from . import gpu_reference, selftest
    from .lower import compile_cache  # TVM is imported here, not at `import goinfer.compiler`
    from .models import FAMILIES, layer
    from .models.decoder import build_model
    from .quant import scheme_for

    t0 = time.perf_counter()
    _check_options(options)
    targets = options.targets
    if "cuda" in targets and compile_cache.tvm_api.cuda_compiler_name() is None:
        need = "nvcc (the CUDA toolkit) or pip install 'goinfer[cuda-build]'"
        raise BuildError(f"--target cuda needs a CUDA compiler: {need}")
    output = Path(output) if output is not None else default_output(source, options)
    _check_writable(output)

    # 1. Load: spec, tokenizer, template and lazily-dequantized tensors from the checkpoint.
    # (Nothing is printed before the input is known good, so bad input gets exactly one line.)
    ckpt = load_checkpoint(source)
    spec = ckpt.spec
    if spec.family not in FAMILIES:
        raise BuildError(f"unsupported architecture {spec.family!r}; supported: {', '.join(FAMILIES)}")
    progress(
        f"[1/6] read {source}: {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}, {len(ckpt.tensors)} tensors"
    )

    # 2. Model: the family's module, each weight with the scheme the quant mode picks for it. One
    #    model exports a CPU graph and a GPU graph over the same parameters.
    def pick(parts: Sequence[SourceTensor]) -> ModuleType:
        return scheme_for(options.quant, parts)

    progress(f"[2/6] building the {spec.family} graph ({options.quant}, KV cache {options.kv_dtype})")
    cpu_tiers = compile_cache.tiers_for("llvm", options.num_cores)
    model = build_model(spec, layer(spec.family), pick, ckpt.tensors, cpu_tiers[0][1], options.kv_dtype)

    # 3. Quantize: pack every weight (pure numpy), checking each against the model's parameters.
    tensors, schemes = _pack_weights(model, ckpt, progress)

    # 4. Lower and compile for each target: the CPU's ISA tiers (the host's best, then AVX2 to step
    #    down to) with each tier's self-test kernels, then each GPU; or reuse the modules compiled
    #    for the same graph. A GPU-only bundle still compiles the CPU module, for step 5.
    compiled_tiers = []
    if "llvm" in targets:
        fixtures = selftest.fixtures(layouts=_layouts(model))
        for i, (tier, tier_target) in enumerate(cpu_tiers):
            cores = tier_target["num-cores"]
            progress(f"[4/6] compiling for llvm tier {tier} ({tier_target['mcpu']}, {cores} cores)")
            compiled = compile_cache.compile_model(model, spec, schemes, tier_target, progress)
            key = "llvm" if i == 0 else f"llvm@{tier}"
            compiled_tiers.append((tier, key, compiled, selftest.compile_for(fixtures, tier_target)))
    gpus = []
    for kind in (t for t in targets if t != "llvm"):
        ((arch, gpu_target),) = compile_cache.tiers_for(kind, options.num_cores, options.cuda_arch)
        progress(f"[4/6] compiling for {kind}{' ' + arch if kind == 'cuda' else ''}")
        gpus.append((kind, arch, compile_cache.compile_model(model, spec, schemes, gpu_target, progress)))
    reference = compiled_tiers[0][2] if compiled_tiers else None
    if gpus and reference is None:
        progress("[4/6] compiling the CPU reference for the GPU self-test (not packed)")
        reference = compile_cache.compile_model(model, spec, schemes, cpu_tiers[0][1], progress)
    every = [c for _t, _k, c, _s in compiled_tiers] + [c for _k, _a, c in gpus]
    param_order = every[0].param_names
    if any(c.param_names != param_order for c in every):
        raise BuildError("internal: the compiled modules disagree on the parameter order")
    if missing := [n for n in param_order if n not in tensors]:
        raise BuildError(f"internal: no packed weight for parameters {missing[:3]}")

    # 5. GPU self-test fixture: a fixed prompt's logits from the CPU module, which every GPU that
    #    loads the bundle must reproduce.
    kv = kv_cache(spec, options.kv_dtype)
    gpu_fixture: list[tuple[str, np.ndarray]] = []
    gpu_selftest = None
    if gpus:
        progress(f"[5/6] GPU self-test fixture: {gpu_reference.PROMPT_TOKENS} tokens through the CPU module")
        weights = [tensors[n] for n in param_order]
        gpu_fixture, gpu_selftest = gpu_reference.tensors(reference.library, weights, spec.vocab_size, kv)

    # 6. Pack: manifest + aligned, hashed blobs, written atomically.
    progress(f"[6/6] writing {output}")
    st_tensors, st_cases = selftest.tensors_and_manifest(fixtures) if compiled_tiers else ([], _NO_CASES)
    cpu_entries = [
        manifest.CpuTier(tier=tier, module=key, selftest=f"selftest@{tier}", target=c.target)
        for tier, key, c, _st in compiled_tiers
    ]
    gpu_entries = [
        manifest.GpuModule(
            kind=k,
            arch=a if k == "cuda" else "",
            module=k,
            target=c.target,
            kernels=f"{k}.kernels" if c.kernels else "",
            kernels_source_sha256=c.kernels_source_sha256,
        )
        for k, a, c in gpus
    ]
    contract = _manifest(
        ckpt, options, schemes, param_order, cpu_entries, st_cases, gpu_entries, gpu_selftest
    )
    modules = []
    for tier, key, c, st in compiled_tiers:
        modules += [(key, c.target, c.library), (f"selftest@{tier}", c.target, st)]
    for k, _a, c in gpus:
        modules.append((k, c.target, c.library))
        if c.kernels:
            modules.append((f"{k}.kernels", {**c.target, "format": "cuda-binary"}, c.kernels))
    info = giw.write_bundle(
        output,
        contract.to_json(),
        [
            *((name, tensors[name]) for name in param_order),
            *st_tensors,
            *gpu_fixture,
            _tokenizer_tensor(ckpt),
        ],
        modules,
    )
    seconds = time.perf_counter() - t0
    cached = all(c.from_cache for c in every)
    progress(
        f"built {output} ({info.size / 2**20:.1f} MiB, {spec.family}, {options.quant}, {','.join(targets)}) "
        f"in {seconds:.1f}s{' (modules from cache)' if cached else ''}"
    )
    return BuildResult(output, info.size, info.sha256, seconds, cached)


_NO_CASES = manifest.SelfTest(tolerance=0.0, cases=())


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
            progress(f"[3/6] quantized {i}/{len(weighted)} weights")
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
    gpu_modules: list[manifest.GpuModule],
    gpu_selftest: manifest.GpuSelfTest | None,
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
        build=manifest.Build(target=",".join(options.targets), quant=options.quant),
        gpu_modules=tuple(gpu_modules),
        gpu_selftest=gpu_selftest,
    )
