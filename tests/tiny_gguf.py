"""Tiny random-weight GGUF checkpoints, written with gguf's writer the way convert_hf_to_gguf would.

``write_tiny_gguf(path, family)`` makes a complete file for "llama", "qwen2" or "gemma3": hidden 64,
4 heads of 16, 2 kv heads, intermediate 128, and a small real vocabulary (byte-level BPE for
llama/qwen2, SentencePiece-style with byte fallback for gemma3), with merges learned from a
built-in corpus. The shapes of the families differ where the real checkpoints do:

* llama (like SmolLM2): 2 layers, tied embeddings, Q/K rows stored permuted as the converter does;
* qwen2 (like Qwen2.5): 2 layers, q/k/v biases, a separate ``output.weight``;
* gemma3: 6 layers (5 sliding, 1 global), sliding window 4, norms stored as 1 + w, no chat template.

The newer families' tiny models (NEW_MODELS), each with its real family's chat template
(tests/fixtures/templates) and its special tokens, and positions past ORIGINAL_CONTEXT where the
RoPE is scaled:

* qwen3 (like Qwen3-0.6B): q/k norms per head, head_dim 32 (q is wider than hidden), tied
  embeddings, ``<think>``/``</think>`` and ``<tool_call>``/``</tool_call>`` as single tokens;
* llama3 (like Llama 3.2): llama with Llama 3.x rope_scaling, which GGUF stores as ``rope_freqs``;
* yarn: llama with YaRN rope_scaling (``rope.scaling.*`` keys in GGUF);
* phi3 (like Phi-4-mini): fused qkv and gate_up, half the head dims rotated, longrope factors, a
  sliding window of 48, a separate ``output.weight``;
* mistral (like Mistral Nemo): llama-shaped with a sliding window of 8; its GGUF says "llama".

``chat_template`` and ``extra_tokens`` (appended to the vocabulary as single, non-special tokens)
make variants of any of them.

``tiny_weights(family)`` gives the same float32 weights before the GGUF permutation and encoding,
so tests can check what a loader returns. ``rewrite_gguf`` copies a file with edits (metadata,
architecture, dropped or re-typed tensors) to make the broken or unusual files that error paths need.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType, quants

FAMILIES = ("llama", "qwen2", "gemma3")
NEW_MODELS = ("qwen3", "llama3", "yarn", "phi3", "mistral")
MODELS = FAMILIES + NEW_MODELS
# Each tiny model's GGUF architecture and config.json model_type.
ARCH = {"llama3": "llama", "yarn": "llama", "mistral": "llama"}
MODEL_TYPE = {"llama3": "llama", "yarn": "llama", "gemma3": "gemma3_text"}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
CONTEXT = 256
SLIDING_WINDOW = 4
LAYERS = {"llama": 2, "qwen2": 2, "gemma3": 6, **dict.fromkeys(NEW_MODELS, 2)}
HEAD_DIMS = {"qwen3": 32}  # Qwen3's q and k are wider than hidden (0.6B: 16 heads of 128 over 1024)
# The context the scaled ropes were "trained" at: tests run to positions well past it.
ORIGINAL_CONTEXT = 64
# transformers' rope_scaling of the tiny models that scale (with theta 500000 and 16 dims, Llama 3's
# rule keeps frequency 0, blends 1 and divides the rest; YaRN's ramp spans dims 0..3 at theta 10000).
ROPE_SCALING: dict[str, dict[str, Any]] = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT,
             "beta_fast": 32.0, "beta_slow": 1.0},
    "phi3": {"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0],
             "long_factor": [1.0, 2.5, 5.0, 9.0]},
}  # fmt: skip
PARTIAL_ROTARY = {"phi3": 0.5}
WINDOWS = {"mistral": 8, "phi3": 48}  # sliding windows over every layer
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
TEMPLATE_FILES = {"qwen3": "qwen3.jinja", "llama3": "llama3.2.jinja", "phi3": "phi3.5.jinja",
                  "mistral": "mistral-nemo.jinja"}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A model's dimensions; the default is the tiny one every test uses. A larger one (a real
    model's layer shapes, few layers, the tiny vocabulary) makes a synthetic file for benchmarks."""

    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    ffn: int = FFN
    context: int = CONTEXT
    layers: int | None = None  # None: the family's (LAYERS)

    def n_layers(self, family: str) -> int:
        return self.layers if self.layers is not None else LAYERS[family]

    def of(self, model: str) -> Shape:
        """The tiny shape as `model` has it (qwen3's wider heads); any other shape as it is."""
        return replace(self, head_dim=HEAD_DIMS[model]) if self == TINY and model in HEAD_DIMS else self


TINY = Shape()
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "gemma3": 1000000.0, "qwen3": 1000000.0,
              "llama3": 500000.0, "yarn": 10000.0, "phi3": 10000.0, "mistral": 1000000.0}  # fmt: skip
# general.file_type (llama_ftype) per encoding of the 2-D weights.
FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the
woods. Once upon a time there was a little model that wanted to learn how to write code and talk.
def add(a, b):
    return a + b
for i in range(10): print(i, add(i, i))
It is what it is, and that is that. She said: "We're here, they've gone, I'll stay, you'd go."
Numbers like 12, 345 and 6789 appear in text; so do symbols such as #, $, %, & and (brackets).
"""

# llama_token_type values.
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6


def write_tiny_gguf(
    path: str | Path,
    family: str,
    *,
    seed: int = 0,
    tensor_type: str = "F32",
    shape: Shape = TINY,
    split_max_tensors: int = 0,
    chat_template: str | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """Write a tiny ``family`` checkpoint (one of MODELS) to ``path``; 2-D weights are stored as
    ``tensor_type``. With ``split_max_tensors``, gguf-split style shards
    ``<stem>-00001-of-0000N.gguf`` beside ``path`` instead: the first shard is returned.
    ``chat_template`` replaces the model's own; ``extra_tokens`` join its vocabulary (single tokens,
    not special, as Qwen3's ``<think>``)."""
    if family not in MODELS:
        raise ValueError(f"unknown family {family!r}; one of {MODELS}")
    if tensor_type not in FILE_TYPES:
        raise ValueError(f"unsupported tensor_type {tensor_type!r}; one of {tuple(FILE_TYPES)}")
    path = Path(path)
    shape = shape.of(family)
    arch = ARCH.get(family, family)
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_hparams(w, family, tensor_type, shape, extra_tokens)
    _write_vocab(w, family, extra_tokens)
    template = chat_template if chat_template is not None else tiny_template(family)
    if template:
        w.add_chat_template(template)
    qtype = GGMLQuantizationType[tensor_type]
    weights = tiny_weights(family, seed=seed, shape=shape, extra_tokens=extra_tokens)
    for name, array in (weights | rope_tables(family, shape)).items():
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            array = _permute(array, shape.heads if ".attn_q." in name else shape.kv_heads)
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, array)  # norms and biases stay F32, as converters keep them
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return shards[0] if split_max_tensors and shards else path


def tiny_template(family: str) -> str | None:
    """The tiny model's chat template: its real family's (fixtures), ChatML, or none (gemma3)."""
    if family in TEMPLATE_FILES:
        return (TEMPLATES / TEMPLATE_FILES[family]).read_text(encoding="utf-8")
    return None if family == "gemma3" else CHATML


def rope_tables(family: str, shape: Shape = TINY) -> dict[str, np.ndarray]:
    """The RoPE tables convert_hf_to_gguf writes as tensors (its LlamaModel and Phi3MiniModel)."""
    scaling = ROPE_SCALING.get(family, {})
    rot = int(shape.of(family).head_dim * PARTIAL_ROTARY.get(family, 1.0))
    if scaling.get("rope_type") == "llama3":
        freqs = 1.0 / (ROPE_THETA[family] ** (np.arange(0, rot, 2, dtype=np.float32) / rot))
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": np.asarray(out, np.float32)}
    if scaling.get("type") == "longrope":  # Phi-3 configs spell it "type"
        return {
            "rope_factors_long.weight": np.asarray(scaling["long_factor"], np.float32),
            "rope_factors_short.weight": np.asarray(scaling["short_factor"], np.float32),
        }
    return {}


def tiny_weights(
    family: str, *, seed: int = 0, shape: Shape = TINY, extra_tokens: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """The float32 weights of the tiny ``family`` model in numpy (out, in) order, Q/K rows half-split
    (phi3's fused: attn_qkv, and ffn_up holding the gate's rows then the up's)."""
    shape = shape.of(family)
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab(family, extra_tokens)[0])

    def linear(out: int, inp: int, std: float = 0.05) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.05).astype(np.float32)

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    hidden, ffn = shape.hidden, shape.ffn
    weights = {"token_embd.weight": linear(vocab, hidden, 0.1), "output_norm.weight": norm(hidden)}
    if family in ("qwen2", "phi3", "mistral"):
        weights["output.weight"] = linear(vocab, hidden, 0.1)
    for i in range(shape.n_layers(family)):
        b = f"blk.{i}."
        weights |= {
            b + "attn_norm.weight": norm(hidden),
            b + "attn_q.weight": linear(q, hidden),
            b + "attn_k.weight": linear(kv, hidden),
            b + "attn_v.weight": linear(kv, hidden),
            b + "attn_output.weight": linear(hidden, q),
            b + "ffn_norm.weight": norm(hidden),
            b + "ffn_gate.weight": linear(ffn, hidden),
            b + "ffn_up.weight": linear(ffn, hidden),
            b + "ffn_down.weight": linear(hidden, ffn),
        }
        if family == "qwen2":
            weights |= {
                b + "attn_q.bias": (rng.standard_normal(q) * 0.02).astype(np.float32),
                b + "attn_k.bias": (rng.standard_normal(kv) * 0.02).astype(np.float32),
                b + "attn_v.bias": (rng.standard_normal(kv) * 0.02).astype(np.float32),
            }
        if family == "gemma3":
            weights |= {
                b + "attn_q_norm.weight": norm(shape.head_dim),
                b + "attn_k_norm.weight": norm(shape.head_dim),
                b + "post_attention_norm.weight": norm(hidden),
                b + "post_ffw_norm.weight": norm(hidden),
            }
        if family == "qwen3":
            weights |= {
                b + "attn_q_norm.weight": norm(shape.head_dim),
                b + "attn_k_norm.weight": norm(shape.head_dim),
            }
        if family == "phi3":
            qkv = [weights.pop(b + f"attn_{n}.weight") for n in "qkv"]
            gate_up = [weights.pop(b + f"ffn_{n}.weight") for n in ("gate", "up")]
            weights |= {
                b + "attn_qkv.weight": np.concatenate(qkv),
                b + "ffn_up.weight": np.concatenate(gate_up),
            }
    return weights


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf's LlamaModel.permute: half-split RoPE rows -> interleaved pairs, per head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_hparams(
    w: GGUFWriter, family: str, tensor_type: str, shape: Shape = TINY, extra_tokens: tuple[str, ...] = ()
) -> None:
    w.add_name(f"tiny-{family}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.n_layers(family))
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(ROPE_THETA[family])
    w.add_layer_norm_rms_eps(RMS_EPS.get(family, 1e-6))
    w.add_file_type(FILE_TYPES[tensor_type])
    if ARCH.get(family, family) == "llama":
        w.add_vocab_size(len(tiny_vocab(family, extra_tokens)[0]))
        w.add_rope_dimension_count(shape.head_dim)
    if family in ("gemma3", "qwen3"):
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if family == "gemma3":
        w.add_sliding_window(SLIDING_WINDOW)
    if family in WINDOWS:
        w.add_sliding_window(WINDOWS[family])
    if family == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        w.add_rope_dimension_count(int(shape.head_dim * PARTIAL_ROTARY[family]))
        w.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        scale = shape.context / ORIGINAL_CONTEXT
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL_CONTEXT)))
    if family == "yarn":  # TextModel.set_gguf_parameters
        r = ROPE_SCALING[family]
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(r["factor"])
        w.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(r["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(r["beta_slow"])
    if tensor_type not in ("F32", "F16", "BF16"):
        w.add_quantization_version(2)


RMS_EPS = {"llama": 1e-5, "llama3": 1e-5, "yarn": 1e-5, "phi3": 1e-5, "mistral": 1e-5}


# The new models' special tokens (control), and (bos, eos, unk, add_bos) among them.
_SPECIALS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
    "phi3": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "mistral": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
}  # fmt: skip
_USER_TOKENS = {"qwen3": ["<tool_call>", "</tool_call>", "<think>", "</think>"]}
ROLE_TOKENS: dict[str, tuple[str | None, str, str | None, bool]] = {
    "qwen3": ("<|endoftext|>", "<|im_end|>", None, False),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", None, True),
    "phi3": ("<|endoftext|>", "<|endoftext|>", None, False),
    "mistral": ("<s>", "</s>", "<unk>", True),
}
# tokenizer.ggml.pre of the byte-level models (each splits as its tokenizer.json in tiny_hf does).
PRE = {"llama": "smollm", "yarn": "smollm", "qwen2": "qwen2", "qwen3": "qwen2", "llama3": "llama-bpe",
       "phi3": "gpt-4o", "mistral": "tekken"}  # fmt: skip


def _write_vocab(w: GGUFWriter, family: str, extra_tokens: tuple[str, ...] = ()) -> None:
    tokens, types, extra = tiny_vocab(family, extra_tokens)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    if family in ROLE_TOKENS:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(PRE[family])
        w.add_token_merges(list(extra))
        ids = {t: i for i, t in enumerate(tokens)}
        bos, eos, unk, add_bos = ROLE_TOKENS[family]
        if bos is not None:
            w.add_bos_token_id(ids[bos])
        w.add_eos_token_id(ids[eos])
        if unk is not None:
            w.add_unk_token_id(ids[unk])
        w.add_add_bos_token(add_bos)
        return
    if family == "gemma3":
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores(list(extra))
        ids = {t: i for i, t in enumerate(tokens)}
        w.add_bos_token_id(ids["<bos>"])
        w.add_eos_token_id(ids["<eos>"])
        w.add_unk_token_id(ids["<unk>"])
        w.add_pad_token_id(ids["<pad>"])
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        return
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE[family])
    w.add_token_merges(list(extra))
    ids = {t: i for i, t in enumerate(tokens)}
    if family in ("llama", "yarn"):  # SmolLM2's choices
        w.add_bos_token_id(ids["<|im_start|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_unk_token_id(ids["<|endoftext|>"])
        w.add_pad_token_id(ids["<|im_end|>"])
        w.add_add_space_prefix(False)
    else:  # Qwen2.5's
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)


@functools.cache
def tiny_vocab(
    family: str, extra_tokens: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...] | tuple[float, ...]]:
    """(tokens, token types, merges for byte-level BPE or scores for SentencePiece); `extra_tokens`
    follow the model's own, as user-defined tokens (single tokens, not special)."""
    tokens, types, extra = _spm_vocab() if family == "gemma3" else _bpe_vocab(family)
    if dup := [t for t in extra_tokens if t in tokens]:
        raise ValueError(f"{family}: extra token {dup[0]!r} is already in the vocabulary")
    tokens, types = [*tokens, *extra_tokens], [*types, *[_USER_DEFINED] * len(extra_tokens)]
    return tuple(tokens), tuple(types), tuple(extra)


def _bpe_vocab(family: str) -> tuple[list[str], list[int], list[str]]:
    table = _byte_to_unicode()
    words = Counter(
        "".join(table[b] for b in w.encode())
        for w in re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", _CORPUS)
    )
    pieces, merges = _train_bpe(words, 120)
    base = [table[b] for b in range(256)]
    merges_text = [f"{a} {b}" for a, b in merges]
    if family in _SPECIALS:
        specials, user = _SPECIALS[family], _USER_TOKENS.get(family, [])
        if family == "mistral":  # tekken puts its specials first
            tokens = specials + base + pieces
            types = [_CONTROL] * len(specials) + [_NORMAL] * (256 + len(pieces))
        else:
            tokens = [*base, *pieces, *specials, *user]
            types = [_NORMAL] * (256 + len(pieces)) + [_CONTROL] * len(specials) + [_USER_DEFINED] * len(user)
        return tokens, types, merges_text
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if family in ("llama", "yarn"):  # SmolLM2 puts its specials first
        tokens = specials + base + pieces
        types = [_CONTROL] * 3 + [_NORMAL] * (256 + len(pieces))
    else:  # Qwen2.5 puts them last, with a user-defined one among them
        tokens = [*base, *pieces, *specials, "<tool_call>"]
        types = [_NORMAL] * (256 + len(pieces)) + [_CONTROL] * 3 + [_USER_DEFINED]
    return tokens, types, merges_text


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    words = Counter("▁" + w for w in _CORPUS.split())
    pieces, _ = _train_bpe(words, 120)
    chars = sorted({c for w in words for c in w})
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  "]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + user + byte_tokens + pieces + chars
    types = [_CONTROL] * len(specials) + [_USER_DEFINED] * len(user) + [_BYTE] * 256
    types += [_NORMAL] * (len(pieces) + len(chars))
    # SentencePiece BPE scores: merged pieces by merge order, then the characters below them.
    scores = [-1000.0] * (len(specials) + len(user)) + [0.0] * 256
    scores += [-float(i) for i in range(len(pieces) + len(chars))]
    return tokens, types, scores


def _train_bpe(words: Counter[str], n_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Greedy BPE over ``words`` (most frequent pair first, ties by text): new pieces and merges."""
    splits = {w: list(w) for w in words}
    pieces: list[str] = []
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            s = splits[w]
            for pair in itertools.pairwise(s):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        joined = best[0] + best[1]
        for w, s in splits.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            splits[w] = out
        merges.append(best)
        if joined not in pieces:
            pieces.append(joined)
    return pieces, merges


def _byte_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map above U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def rewrite_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    arch: str | None = None,
    set_keys: Mapping[str, Any] | None = None,
    drop: Iterable[str] = (),
    retype: Mapping[str, type] | None = None,
    donor: tuple[str | Path, str] | None = None,
) -> Path:
    """Copy ``src`` to ``dst``: ``arch`` replaces general.architecture, ``set_keys`` adds or replaces
    metadata (bool, int -> u32, float -> f32, str, or a list of one of those), ``drop`` removes keys
    and tensors by name, and ``retype`` stores the named tensors as another numpy dtype (e.g.
    ``np.float64`` gives an F64 tensor). ``donor`` = (path, part): tensors whose names contain part
    are taken as that GGUF stores them (the same tiny model in another encoding: a mixed file)."""
    reader = GGUFReader(str(src))
    drop, set_keys, retype = set(drop), dict(set_keys or {}), dict(retype or {})
    w = GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop or name in set_keys:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, value in set_keys.items():
        w.add_key_value(name, value, *_value_type(value))
    donated = {}
    if donor is not None:
        donated = {t.name: t for t in GGUFReader(str(donor[0])).tensors if donor[1] in t.name}
    for t in (donated.get(t.name, t) for t in reader.tensors):
        if t.name in drop:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.name in retype:
            data = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(retype[t.name])
            w.add_tensor(t.name, data)
        elif t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def _value_type(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    def scalar(v: Any) -> GGUFValueType:
        if isinstance(v, bool):
            return GGUFValueType.BOOL
        if isinstance(v, int):
            return GGUFValueType.UINT32
        if isinstance(v, float):
            return GGUFValueType.FLOAT32
        return GGUFValueType.STRING

    if isinstance(value, list):
        return GGUFValueType.ARRAY, scalar(value[0])
    return scalar(value), None
