"""`goinfer build`: checkpoint -> quantized, compiled, packed .giw bundle, in numbered steps."""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from goinfer.artifacts import giw, manifest
from goinfer.artifacts.manifest import (  # the attention kernels' page (no TVM imported)
    DEFAULT_KV_DTYPE,
    PAGE_SIZE,
)

from . import __version__
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
    from . import (
        compile_cache,  # TVM is imported here, not at `import goinfer.compiler`
        gpu_reference,
        selftest,
    )
    from .models import FAMILIES, family
    from .quant import ENCODER_MODES, scheme_for
    from .tvm import targets as tvm_targets  # a local `targets` is the option's

    t0 = time.perf_counter()
    _check_options(options)
    targets = options.targets
    if "cuda" in targets and tvm_targets.cuda_compiler_name() is None:
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
    fam = family(spec.family)
    if fam.kind == "encoder" and (gpu := [t for t in targets if t != "llvm"]):
        raise BuildError(f"{spec.family} is an encoder: encoders build for llvm only, not {gpu[0]}")
    if fam.kind == "encoder" and options.quant not in ("gguf", *ENCODER_MODES):
        raise BuildError(
            f"{spec.family} is an encoder: --quant {options.quant} is not offered for encoders "
            f"(choose {' or '.join(ENCODER_MODES)}: the others lose cosine to f32, quant/__init__.py)"
        )
    progress(
        f"[1/6] read {source}: {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}, {len(ckpt.tensors)} tensors"
    )

    # 2. Model: the family's module, each weight with the scheme the quant mode picks for it. One
    #    model exports a CPU graph and a GPU graph over the same parameters.
    def pick(parts: Sequence[SourceTensor]) -> ModuleType:
        return scheme_for(options.quant, parts)

    what = f"KV cache {options.kv_dtype}" if fam.kind == "decoder" else f"{ckpt.embedding.pooling} pooling"
    progress(f"[2/6] building the {spec.family} {fam.kind} graph ({options.quant}, {what})")
    cpu_tiers = compile_cache.tiers_for("llvm", options.num_cores)
    # An encoder's graph ends in its pooling (the checkpoint's), a decoder's in its KV cache.
    extra = {"pooling": ckpt.embedding.pooling} if fam.kind == "encoder" else {}
    model = fam.build(spec, pick, ckpt.tensors, cpu_tiers[0][1], options.kv_dtype, **extra)
    weighted, schemes = _weighted(model, ckpt, progress)
    # The parameters in the order the entry points take them (the exporter's: each compiled module's
    # own list is checked against it below), with the shapes the packed weights must have.
    declared = [(name, tuple(int(d) for d in p.shape), p.dtype) for name, p in model.named_parameters()]
    param_order = [name for name, _s, _d in declared]

    # 3. Lower and compile what the cache lacks (same graph, schemes and target: a warm build
    #    compiles nothing): the CPU's ISA tiers (the host's best, then AVX2 to step down to) with
    #    each tier's self-test kernels, then each GPU. A GPU-only bundle still compiles the CPU
    #    module, for step 5.
    gpu_kinds = [t for t in targets if t != "llvm"]
    gpu_tiers = {
        kind: compile_cache.tiers_for(kind, options.num_cores, options.cuda_arch)[0] for kind in gpu_kinds
    }
    cpu_wanted = cpu_tiers if "llvm" in targets else cpu_tiers[:1]  # GPU-only: the CPU reference
    layouts = _layouts(model)
    cases = selftest.cases(layouts=layouts) if "llvm" in targets else {}
    compiled, st_libs = _compile(model, spec, schemes, cpu_wanted, gpu_tiers, cases, layouts, progress)
    compiled_tiers = [
        (tier, "llvm" if i == 0 else f"llvm@{tier}", compiled[tier], st_libs[tier])
        for i, (tier, _t) in enumerate(cpu_tiers)
        if "llvm" in targets
    ]
    gpus = [(kind, gpu_tiers[kind][0], compiled[kind]) for kind in gpu_kinds]
    every = [c for _t, _k, c, _s in compiled_tiers] + [c for _k, _a, c in gpus]
    if any(c.param_names != param_order for c in every):
        raise BuildError("internal: the compiled modules disagree on the parameter order")
    st_tensors, st_cases = selftest.tensors_and_manifest(cases) if cases else ([], _NO_CASES)

    with giw.BundleWriter(output) as writer:
        # 4. Quantize, streaming: every weight packed on a pool of threads (a slice of rows at a
        #    time where the scheme allows), each piece hashed and written to its place in the
        #    bundle as it comes. The table comes first: the parameters, the self-test's tensors,
        #    the tokenizer (after the GPU fixture, which needs the packed weights). After the
        #    compile, not beside it: numpy's Python half and TVM's contend for the GIL, and each
        #    step alone has both cores (the 0.5B's pack: 1.2 s alone, +1.7 s to a compile beside).
        tokenizer = _tokenizer_tensor(ckpt)
        small = [*st_tensors, *([] if gpu_kinds else [tokenizer])]
        for name, shape, dtype in declared:
            writer.add_tensor(name, dtype, shape)
        for name, arr in small:
            writer.add_tensor(name, arr.dtype, arr.shape)
        if not gpu_kinds:  # the manifest's final length: the data goes straight to its place
            writer.plan(
                *_contract_and_modules(
                    ckpt, options, schemes, param_order, compiled_tiers, st_cases, [], None
                )
            )
        for name, arr in small:
            writer.write(name, arr)
        packed_in, written = _stream_weights(weighted, ckpt, writer, progress)
        if missing := [n for n in param_order if n not in written]:
            raise BuildError(f"internal: no packed weight for parameters {missing[:3]}")
        progress(f"[4/6] quantized {len(weighted)} weights in {packed_in:.1f}s")

        # 5. GPU self-test fixture: a fixed prompt's logits from the CPU module, which every GPU
        #    that loads the bundle must reproduce.
        kv = kv_cache(spec, options.kv_dtype)
        gpu_selftest = None
        if gpus:
            progress(
                f"[5/6] GPU self-test fixture: {gpu_reference.PROMPT_TOKENS} tokens through the CPU module"
            )
            reference = compiled[cpu_tiers[0][0]]
            weights = [writer.tensor(n) for n in param_order]  # mapped back from the bundle
            fixture, gpu_selftest = gpu_reference.tensors(reference.library, weights, spec.vocab_size, kv)
            del weights
            for name, arr in fixture:
                writer.put(name, arr)
            writer.put(*tokenizer)

        # 6. Pack: the modules and the manifest, then the header; renamed into place.
        progress(f"[6/6] writing {output}")
        contract, modules = _contract_and_modules(
            ckpt, options, schemes, param_order, compiled_tiers, st_cases, gpus, gpu_selftest
        )
        info = writer.finish(contract, modules)
    seconds = time.perf_counter() - t0
    cached = all(c.from_cache for c in every)
    progress(
        f"built {output} ({info.size / 2**20:.1f} MiB, {spec.family}, {options.quant}, {','.join(targets)}) "
        f"in {seconds:.1f}s{' (modules from cache)' if cached else ''}"
    )
    return BuildResult(output, info.size, info.sha256, seconds, cached)


def _contract_and_modules(
    ckpt: Checkpoint,
    options: BuildOptions,
    schemes: dict[str, str],
    param_order: list[str],
    compiled_tiers: list[tuple[str, str, Any, bytes]],
    st_cases: manifest.SelfTest,
    gpus: list[tuple[str, str, Any]],
    gpu_selftest: manifest.GpuSelfTest | None,
) -> tuple[dict[str, Any], list[tuple[str, dict, bytes]]]:
    """The manifest and the module blobs, in the bundle's order."""
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
    ).to_json()
    modules = []
    for tier, key, c, st in compiled_tiers:
        modules += [(key, c.target, c.library), (f"selftest@{tier}", c.target, st)]
    for k, _a, c in gpus:
        modules.append((k, c.target, c.library))
        if c.kernels:
            modules.append((f"{k}.kernels", {**c.target, "format": "cuda-binary"}, c.kernels))
    return contract, modules


def _compile(
    model,
    spec: manifest.ModelSpec,
    schemes: dict[str, str],
    cpu_tiers: list[tuple[str, dict]],
    gpu_tiers: dict[str, tuple[str, dict]],
    cases: dict,
    layouts: tuple,
    progress: Progress,
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """tier or GPU kind -> its Compiled module, and tier -> its self-test library: from the cache,
    or compiled now. Every library compiles on its own thread: TVM's passes and LLVM release the
    GIL, so the cores share them (the 0.5B's two tiers, 2 cores: 9 + 10 s one after the other,
    6 s side by side), and the model is exported once, beside the self-test's compiles."""
    from . import compile_cache, selftest
    from .tvm import targets

    compiled = {}
    for tier, tgt in cpu_tiers:
        found = compile_cache.lookup(model.graph_variant, spec, schemes, tgt)
        state = "compiled before" if found is not None else "compiling"
        progress(f"[3/6] llvm tier {tier} ({tgt['mcpu']}, {tgt['num-cores']} cores): {state}")
        if found is not None:
            compiled[tier] = found
    st_libs = {tier: selftest.cached_library(layouts, tgt) for tier, tgt in cpu_tiers} if cases else {}
    todo = [(tier, tgt) for tier, tgt in cpu_tiers if tier not in compiled]
    st_todo = [(tier, tgt) for tier, tgt in cpu_tiers if tier in st_libs and st_libs[tier] is None]
    with ThreadPoolExecutor(max_workers=max(1, len(todo) + len(st_todo))) as pool:
        # The self-test's libraries first: their compiles take the other core while this one
        # exports the model (TVMScript, holding the GIL), then the tiers compile on both.
        funcs = selftest.kernels(cases) if st_todo else {}
        st_jobs = {tier: pool.submit(selftest.compile_kernels, funcs, tgt) for tier, tgt in st_todo}
        cpu_graph = _export(model, None, progress) if todo else None  # once, for every tier
        compile_tier = functools.partial(compile_cache.compile_model, cpu_graph, model.graph_variant)
        jobs = {tier: pool.submit(compile_tier, spec, schemes, tgt, progress) for tier, tgt in todo}
        for tier, job in jobs.items():
            compiled[tier] = job.result()
        for tier, tgt in st_todo:
            st_libs[tier] = st_jobs[tier].result()
            selftest.store_library(layouts, tgt, st_libs[tier])
    for kind, (arch, tgt) in gpu_tiers.items():
        progress(f"[3/6] compiling for {kind}{' ' + arch if kind == 'cuda' else ''}")
        found = compile_cache.lookup(model.graph_variant, spec, schemes, tgt, progress)
        graph = _export(model, targets.make_target(tgt), progress) if found is None else None
        compiled[kind] = found or compile_cache.compile_model(
            graph, model.graph_variant, spec, schemes, tgt, progress
        )
    return compiled, st_libs


def _export(model, target, progress: Progress):
    """The model's Relax graph for `target`'s kind (None: the CPU's)."""
    t = time.perf_counter()
    graph = model.exported(target)
    progress(f"      exported {len(graph[0].functions_items())} functions in {time.perf_counter() - t:.1f}s")
    return graph


_NO_CASES = manifest.SelfTest(tolerance=0.0, cases=())


def _layouts(model) -> tuple:
    """The grouped affine layouts the model's weights use: each is a self-test fixture."""
    from .models.layers import QLinear
    from .tvm import graph

    found = {m.scheme.layout for _p, m in graph.modules_of_type(model, QLinear)}
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


def _weighted(model, ckpt: Checkpoint, progress: Progress) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """(prefix, module) of every module with packed weights, and each one's scheme name."""
    from .models.layers import Weighted
    from .tvm import graph

    weighted = graph.modules_of_type(model, Weighted)
    schemes: dict[str, str] = {}
    used: set[str] = set()
    for prefix, module in weighted:
        schemes[prefix] = module.scheme.NAME if module.scheme is not None else "f32"
        used.update(module.sources)
    kinds = Counter(schemes[prefix] for prefix, module in weighted if module.scheme is not None)
    progress("      schemes: " + ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())))
    unused = sorted(set(ckpt.tensors) - used)
    if unused:
        progress(f"      note: {len(unused)} checkpoint tensors unused: {', '.join(unused[:4])}")
    return weighted, schemes


Piece = Callable[[], dict[str, np.ndarray]]  # packs one slice of a weight's rows (or all of it)


def _pieces(module, ckpt: Checkpoint) -> tuple[list[Piece], Callable[[], None]]:
    """A weight's packing as tasks, in order: slices of rows where its scheme transcodes blocks
    (quant/gguf.py: every parameter has its row blocks on axis 0, so the slices' parameters
    concatenate), else one task for the whole; and what to call once they are all done."""
    whole = [functools.partial(module.pack, ckpt.tensors)], lambda: None
    if module.scheme is None:  # a norm's or a bias's float32
        return whole
    rows = module.scheme.rows(module.parts(ckpt.tensors))
    if rows is None:
        return whole
    return [functools.partial(rows.pack, a, b) for a, b in rows.pieces()], rows.release


class _Packed:
    """Checks a weight's packed pieces against the parameters its module declares."""

    def __init__(self, prefix: str, module) -> None:
        self.prefix, self.module = prefix, module
        self.rows: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}
        self.tails: dict[str, tuple[int, ...]] = {}

    def add(self, key: str, arr: np.ndarray) -> str:
        """The parameter's bundle name, once this piece of it fits what is declared."""
        declared = getattr(self.module, key)
        shape = tuple(int(x) for x in declared.shape)
        rows = self.rows.get(key, 0) + (arr.shape[0] if arr.ndim else 1)
        self.rows[key], self.dtypes[key], self.tails[key] = rows, str(arr.dtype), tuple(arr.shape[1:])
        if (
            str(arr.dtype) != declared.dtype
            or arr.shape[1:] != shape[1:]
            or rows > (shape[0] if shape else 1)
        ):
            self.refuse(key)
        return f"{self.prefix}.{key}"

    def check(self) -> None:
        for key, rows in self.rows.items():
            shape = tuple(int(x) for x in getattr(self.module, key).shape)
            if rows != (shape[0] if shape else 1):
                self.refuse(key)

    def refuse(self, key: str) -> None:
        declared = getattr(self.module, key)
        packed = [self.rows[key], *self.tails[key]]
        raise BuildError(
            f"{self.prefix}.{key}: packed {self.dtypes[key]}{packed}, "
            f"model declares {declared.dtype}{list(declared.shape)}"
        )


def _pack_weights(
    model, ckpt: Checkpoint, progress: Progress
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every weight packed in memory (tests; a build streams them into the bundle: `_stream_weights`)."""
    weighted, schemes = _weighted(model, ckpt, progress)
    tensors: dict[str, np.ndarray] = {}
    for prefix, module in weighted:
        check, pieces = _Packed(prefix, module), {}
        tasks, done = _pieces(module, ckpt)
        for piece in tasks:
            for key, arr in piece().items():
                pieces.setdefault(check.add(key, arr), []).append(arr)
        check.check()
        done()
        tensors |= {name: p[0] if len(p) == 1 else np.concatenate(p) for name, p in pieces.items()}
    return tensors, schemes


def _stream_weights(
    weighted: list[tuple[str, Any]], ckpt: Checkpoint, writer: giw.BundleWriter, progress: Progress
) -> tuple[float, set[str]]:
    """Pack every weight into the bundle on a pool of threads (numpy releases the GIL on big
    arrays); returns the seconds it took and the parameters written. This thread hands out the
    pieces, a few ahead of the one it waits for, and writes each packed piece to the bundle in
    order (hashing and writing release the GIL too): a few pieces are in memory at a time, never
    the model. Each weight's checkpoint pages are let go once it is packed (`Rows.release`)."""
    t0 = time.perf_counter()
    workers = _pack_workers()
    tasks = (
        (i, prefix, module, piece, done if last else None)
        for i, (prefix, module) in enumerate(weighted, 1)
        for pieces, done in [_pieces(module, ckpt)]
        for piece, last in _with_last(pieces)
    )
    ahead: deque[tuple[tuple, Future]] = deque()
    check: _Packed | None = None
    written: set[str] = set()

    def write_next() -> None:
        nonlocal check
        (i, prefix, module, _piece, done), future = ahead.popleft()
        if check is None:
            check = _Packed(prefix, module)
        for key, arr in future.result().items():
            name = check.add(key, arr)
            writer.write(name, arr)
            written.add(name)
        if done is not None:  # the weight's last piece: all of its pieces are in
            check.check()
            done()
            check = None
            if i % 16 == 0 or i == len(weighted):
                progress(f"[4/6] quantized {i}/{len(weighted)} weights")

    with ThreadPoolExecutor(workers, thread_name_prefix="goinfer-pack") as pool:
        try:
            for task in tasks:
                ahead.append((task, pool.submit(task[3])))
                if len(ahead) > 2 * workers:
                    write_next()
            while ahead:
                write_next()
        finally:  # on an error, the pieces not started are dropped
            for _task, future in ahead:
                future.cancel()
    return time.perf_counter() - t0, written


# Threads packing weights: each holds a piece (~1M weights: ~10 MB of temporaries) and two more
# wait per thread, so more threads than this would cost memory for little (numpy's Python half
# and the one writing thread would hold them back).
MAX_PACK_WORKERS = 8


def _pack_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_PACK_WORKERS))


def _with_last(items: list) -> list[tuple[Any, bool]]:
    return [(item, i == len(items) - 1) for i, item in enumerate(items)]


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

    from .models import family

    kind = family(ckpt.spec.family).kind
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
        kv_cache=kv_cache(ckpt.spec, options.kv_dtype) if kind == "decoder" else None,
        entry_points=family(ckpt.spec.family).entry_points,  # as the family's kind declares
        cpu_tiers=tuple(cpu_tiers),
        selftest=selftest,
        source=manifest.Source(ref=_source_ref(ckpt.source), sha256=ckpt.sha256),
        build=manifest.Build(target=",".join(options.targets), quant=options.quant),
        gpu_modules=tuple(gpu_modules),
        gpu_selftest=gpu_selftest,
        kind=kind,
        embedding=ckpt.embedding,
    )


def _source_ref(source: str) -> str:
    """What the manifest names as the source: an hf: reference whole, a local path by its name."""
    return source if source.startswith("hf:") else Path(source).name
