"""The bundle contract: what a .giw manifest says, typed, with each fact in one place.

The compiler builds a `Manifest` and writes `to_json()`; the runtime, the server and `goinfer
inspect` read `Manifest.from_json(bundle.manifest)` and use attributes. `from_json` refuses a
manifest with a missing, unknown or mistyped field as a BundleError naming the field, so a bundle
that loads has every fact the runtime reads.

Family and context length live in `model` only, the quant in `build` only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .giw import FORMAT_VERSION, RESERVED_KEYS, Bundle, BundleError

# The model families the compiler builds (compiler/models/<family>.py): a checkpoint's
# architecture string, checked by the sources before anything is compiled.
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "mistral", "bert", "nomic_bert")
# What a family is, and the entry points its bundle's module has (compiler/models/__init__.py):
# a decoder generates over a paged KV cache; an encoder maps several inputs, packed, to one
# vector each (`embed`).
ENTRY_POINTS_OF = {
    "decoder": ("prefill_all", "decode", "batch_prefill", "batch_decode", "create_kv_cache"),
    "encoder": ("embed",),
}
ENTRY_POINTS = ENTRY_POINTS_OF["decoder"]
# How an encoder turns its last hidden states into one vector (sentence-transformers' pooling
# modes we build): the mean over the input's tokens, its first token, or its last.
POOLINGS = ("mean", "cls", "last")
# The quant modes an encoder builds in (compiler/quant): its float weights as they are, or GGUF's
# Q8_0 blocks (group-32 scales on weights and activations). all-MiniLM-L6-v2's vectors against
# f32's, min cosine over varied inputs: q8_0 0.9993; int8 (a scale per row, float activations)
# 0.9988; int8int8 (a scale per row and per token) 0.992: below the 0.999 an embedding is held
# to, so those are not offered.
ENCODER_QUANTS = ("f32", "q8_0")
# The KV cache dtypes a bundle may be built with (the compiler's BuildOptions.kv_dtype).
KV_DTYPES = ("float16", "float32")
# The pages' element type unless a build asks otherwise: float16 halves the bytes a decode step
# reads per key (24 -> 12 KiB a token for Qwen2.5-0.5B); the kernels widen it to float32 on load
# and compute in float32. Qwen2.5-Coder-0.5B, 2 threads: decode at 4k tokens of context 39.9 ->
# 44.3 tok/s, at 16k 17.2 -> 20.4; perplexity with float32 weights 30.0275 -> 30.0283 (KL 2e-6
# nats a token; in gguf mode the change is lost in the int8 activations' rounding noise).
DEFAULT_KV_DTYPE = "float16"
# Key/value slots per page of the paged KV cache: TVM's stock CPU kernels' layout, which the
# attention and append kernels keep.
PAGE_SIZE = 16


# The RoPE scalings the compiler builds (RopeScaling.kind). Every kind but linear reaches the graph
# as per-frequency divisors and a cos/sin scale, computed by the source (compiler/sources/rope_scaling.py).
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched past the context a model was trained at. The angle of
    rotated frequency i at position p is p * theta^(-2i/rope_dims) / f_i (linear: p / factor), and
    cos and sin are scaled by attn_factor, where f is freq_factors, or long_factors at positions at
    or past original_context (longrope)."""

    kind: str = "none"  # ROPE_SCALINGS
    factor: float = 1.0
    original_context: int = 0  # the context the model was trained at (yarn, longrope)
    freq_factors: tuple[float, ...] = ()  # one divisor per rotated frequency (llama3, yarn, longrope)
    long_factors: tuple[float, ...] = ()  # longrope: the divisors at positions >= original_context
    attn_factor: float = 1.0  # yarn's mscale, longrope's attention factor: scales cos and sin


@dataclass(frozen=True)
class ModelSpec:
    """Everything the lowering needs to know about a checkpoint: a source fills it in, a model
    family reads it, and the bundle keeps it verbatim."""

    family: str  # registry key of compiler/models (FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    # Family specifics (defaults are llama's).
    activation: str = "silu"  # "silu" | "gelu_tanh" (gated MLP either way); "gelu" (erf: bert)
    embed_scale: float = 1.0  # gemma: sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # gemma RMSNorm uses (offset + w); GGUF already folds the 1 in
    qk_norm: bool = False  # gemma3, qwen3: RMSNorm over each q and k head before RoPE
    post_norms: bool = False  # gemma3: norms after attention and after the MLP too
    attn_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5 (gemma3: query_pre_attn_scalar ** -0.5)
    sliding_window: int = 0  # 0: no sliding-window layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where attention is windowed
    rope_local_theta: float = 0.0  # gemma3: the rope base of the sliding-window layers (0: rope_theta)
    learned_positions: bool = False  # bert: a position embedding table, added to the tokens' (no RoPE)
    rope_dims: int = 0  # the leading dims of each head RoPE rotates (phi3's partial rotary); 0: all

    @property
    def rotary_dims(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def layer_rope_theta(self, layer: int) -> float:
        if self.sliding_layers and self.sliding_layers[layer] and self.rope_local_theta:
            return self.rope_local_theta
        return self.rope_theta

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: Any) -> ModelSpec:
        return _from_json(cls, d, "model")


@dataclass(frozen=True)
class Tokens:
    bos_id: int | None
    add_bos: bool
    stop_ids: tuple[int, ...]  # EOS and EOT: generation stops at any of them


@dataclass(frozen=True)
class KVCache:
    page_size: int  # tokens per page: the attention kernels are built for it
    prefill_chunk: int  # tokens per prefill call: the cache is created for it, prompts are cut to it
    dtype: str = "float32"  # the pages' (and the cache's q/k/v/output) element type: KV_DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise BundleError(
                f"corrupt manifest: kv_cache.dtype is {self.dtype!r}, not one of {', '.join(KV_DTYPES)}"
            )


@dataclass(frozen=True)
class Embedding:
    """An encoder's output: one vector per input, pooled as its checkpoint says, L2-normalized."""

    pooling: str  # POOLINGS
    dimensions: int  # the vector's width (the model's hidden size)
    max_tokens: int  # positions an input may take, its special tokens included
    # Task name -> the text put before an input for it (sentence-transformers' "prompts":
    # {"query": "search_query: ", ...}); empty where the model card defines none.
    prompts: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise BundleError(
                f"corrupt manifest: embedding.pooling is {self.pooling!r}, not one of {', '.join(POOLINGS)}"
            )
        for name, value in (("dimensions", self.dimensions), ("max_tokens", self.max_tokens)):
            if value < 1:
                raise BundleError(f"corrupt manifest: embedding.{name} is {value}, not a positive count")


@dataclass(frozen=True)
class CpuTier:
    tier: str  # "avx512-vnni", "avx2", ...
    module: str  # the model's module key
    selftest: str  # the key of this tier's self-test kernels
    target: Mapping[str, Any]  # the TVM target it was compiled for


@dataclass(frozen=True)
class GpuModule:
    kind: str  # "cuda" | "metal"
    arch: str  # the CUDA compute capability it was compiled for ("sm_90"); "" for Metal
    module: str  # the module key: a shared library (CUDA) or a tar of unlinked objects (Metal)
    target: Mapping[str, Any]  # the TVM target it was compiled for
    # CUDA: the module key of its kernels compiled ahead of time (a fatbin: the arch's SASS and
    # PTX), and the sha256 of the CUDA source they were compiled from. The library keeps that
    # source and asks for it to be compiled at load; the runtime answers with these.
    kernels: str = ""
    kernels_source_sha256: str = ""


@dataclass(frozen=True)
class GpuSelfTest:
    """A fixed prompt and the CPU module's logits for it: a GPU must agree at every position."""

    prompt: str  # tensor name: int32 token ids
    want: str  # tensor name: (tokens, vocab) float32 logits
    min_cosine: float


GPU_KINDS = ("cuda", "metal")


@dataclass(frozen=True)
class SelfTestCase:
    kernel: str
    inputs: tuple[str, ...]  # tensor names
    want: str  # tensor name of the expected output


@dataclass(frozen=True)
class SelfTest:
    tolerance: float  # max |got - want| / max |want|
    cases: tuple[SelfTestCase, ...]


@dataclass(frozen=True)
class Source:
    ref: str  # the checkpoint's file name (no directories: builds stay reproducible across hosts)
    sha256: str


@dataclass(frozen=True)
class Build:
    target: str  # "llvm", ...
    quant: str  # the quant mode asked for; `weight_schemes` says what each weight got


@dataclass(frozen=True)
class Manifest:
    goinfer_version: str
    tvm_version: str
    model: ModelSpec
    tokens: Tokens
    tokenizer_tensor: str  # the tensor holding the tokenizers JSON (UTF-8 bytes)
    chat_template: str
    chat_template_origin: str  # "checkpoint" or "family default: <why>"
    params: tuple[str, ...]  # tensor names, in the order the entry points take them
    weight_schemes: Mapping[str, str]  # module path -> scheme name
    kv_cache: KVCache | None  # a decoder's; None for an encoder
    entry_points: tuple[str, ...]
    cpu_tiers: tuple[CpuTier, ...]  # best first: the self-test picks the first that passes
    selftest: SelfTest
    source: Source
    build: Build
    gpu_modules: tuple[GpuModule, ...] = ()  # the model compiled for GPUs (empty: CPU only)
    gpu_selftest: GpuSelfTest | None = None  # present whenever gpu_modules is not empty
    kind: str = "decoder"  # ENTRY_POINTS_OF's keys: what the model does, and so its entry points
    embedding: Embedding | None = None  # an encoder's output (kind "encoder" only)

    def __post_init__(self) -> None:
        if self.kind not in ENTRY_POINTS_OF:
            raise BundleError(
                f"corrupt manifest: kind is {self.kind!r}, not one of {', '.join(ENTRY_POINTS_OF)}"
            )
        if (self.kind == "decoder") != (self.kv_cache is not None):
            raise BundleError(
                f"corrupt manifest: a{'' if self.kv_cache else ' missing'} kv_cache for a {self.kind}"
            )
        if (self.kind == "encoder") != (self.embedding is not None):
            raise BundleError(
                f"corrupt manifest: a{'' if self.embedding else ' missing'} embedding for a {self.kind}"
            )
        counts = [
            ("model.context_length", self.model.context_length),
            ("model.vocab_size", self.model.vocab_size),
        ]
        if self.kv_cache is not None:
            counts += [("kv_cache.page_size", self.kv_cache.page_size),
                       ("kv_cache.prefill_chunk", self.kv_cache.prefill_chunk)]  # fmt: skip
        for name, value in counts:
            if value < 1:
                raise BundleError(f"corrupt manifest: {name} is {value}, not a positive count")
        if missing := [e for e in ENTRY_POINTS_OF[self.kind] if e not in self.entry_points]:
            raise BundleError(f"corrupt manifest: entry_points lacks {', '.join(missing)}")
        if not self.cpu_tiers and not self.gpu_modules:
            raise BundleError("corrupt manifest: neither cpu_tiers nor gpu_modules names a module")
        if bad := [g.kind for g in self.gpu_modules if g.kind not in GPU_KINDS]:
            raise BundleError(
                f"corrupt manifest: gpu_modules kind {bad[0]!r} is not one of {', '.join(GPU_KINDS)}"
            )
        if self.gpu_modules and self.gpu_selftest is None:
            raise BundleError("corrupt manifest: gpu_modules without a gpu_selftest")

    # Facts kept once, read here under the names callers use.
    @property
    def family(self) -> str:
        return self.model.family

    @property
    def context_length(self) -> int:
        return self.model.context_length

    @property
    def quant(self) -> str:
        return self.build.quant

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        if isinstance(d, Mapping):
            d = {k: v for k, v in d.items() if k not in RESERVED_KEYS}  # the container's tables
        return _from_json(cls, d, "manifest")

    @classmethod
    def of(cls, bundle: Bundle) -> Manifest:
        """The bundle's manifest, checked against what the bundle holds."""
        m = cls.from_json(bundle.manifest)
        names = set(bundle.tensor_names())
        needed = [*m.params, m.tokenizer_tensor, *(n for c in m.selftest.cases for n in (*c.inputs, c.want))]
        if m.gpu_selftest is not None:
            needed += [m.gpu_selftest.prompt, m.gpu_selftest.want]
        if missing := [n for n in needed if n not in names]:
            raise BundleError(f"bundle {bundle.path}: no tensor {missing[0]!r}, which its manifest names")
        keys = set(bundle.module_keys())
        named = [
            *(k for t in m.cpu_tiers for k in (t.module, t.selftest)),
            *(k for g in m.gpu_modules for k in (g.module, g.kernels) if k),
        ]
        if missing := [k for k in named if k not in keys]:
            raise BundleError(f"bundle {bundle.path}: no module {missing[0]!r}, which its manifest names")
        return m


# ------------------------------------------------------------------------------------ (de)serializing


def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_json(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: _to_json(v) for k, v in obj.items()}
    return obj


def _from_json(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise BundleError(f"corrupt manifest: {where} is not an object")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(d) - set(fields)):
        raise BundleError(f"corrupt manifest: unknown field {where}.{unknown[0]}")
    kwargs = {}
    for name, f in fields.items():
        if name in d:
            kwargs[name] = _value(hints[name], d[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BundleError(f"corrupt manifest: {where}.{name} is missing")
    return cls(**kwargs)


def _value(tp: Any, v: Any, where: str) -> Any:
    """`v` read as type `tp` (the few shapes a manifest uses), or a BundleError naming `where`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _value(tp, v, where)
    if dataclasses.is_dataclass(tp):
        return _from_json(tp, v, where)
    if origin is tuple:
        if not isinstance(v, list):
            raise BundleError(f"corrupt manifest: {where} is not a list")
        return tuple(_value(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is Mapping or tp is Mapping:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise BundleError(f"corrupt manifest: {where} is not an object")
        vt = args[1] if args else Any
        return types.MappingProxyType({k: _value(vt, x, f"{where}.{k}") for k, x in v.items()})
    if tp is Any:
        return v
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
        raise BundleError(f"corrupt manifest: {where} is not {tp.__name__}")
    return v


# ------------------------------------------------------------------------------------------ summary


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if x < 1024:
            break
        x, unit = x / 1024, bigger
    return f"{x:.1f} {unit}"


def describe(bundle: Bundle) -> str:
    """A human-readable summary for `goinfer inspect`."""
    m = Manifest.of(bundle)
    infos = [bundle.tensor_info(n) for n in bundle.tensor_names()]
    dtypes = Counter(e.dtype.name for e in infos)
    kv, emb = m.kv_cache, m.embedding
    lines = [
        f"bundle   {bundle.path.name}  {_human(bundle.size)}  format v{FORMAT_VERSION}",
        f"versions goinfer {m.goinfer_version}  tvm {m.tvm_version}",
        f"model    {m.family} ({m.kind})  quant {m.quant}  context {m.context_length}",
        f"kv cache pages of {kv.page_size}  prefill chunks of {kv.prefill_chunk}  {kv.dtype}"
        if kv is not None
        else f"embeds   {emb.dimensions} wide, {emb.pooling} pooling, prompts {', '.join(emb.prompts) or '-'}"
        if emb is not None
        else "",
        f"tensors  {len(infos)}  {_human(sum(e.nbytes for e in infos))}  "
        + ", ".join(f"{k}×{v}" for k, v in sorted(dtypes.items())),
    ]
    for k in bundle.module_keys():
        e = bundle.module_info(k)
        kind = e.target.get("kind", "?")
        arch = f" {e.target['arch']}" if e.target.get("arch") else ""
        lines.append(f"module   {k}  {kind}{arch}  {_human(e.nbytes)}  sha256 {e.sha256[:16]}")
    lines.append(f"source   {m.source.ref}  sha256 {m.source.sha256[:16]}")
    lines.append(f"header   sha256 {bundle.header_sha256[:16]}")
    return "\n".join(lines)
