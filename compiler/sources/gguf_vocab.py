"""A GGUF vocabulary, read the way llama.cpp's ``llama-vocab.cpp`` reads it.

llama.cpp decides some things from token *texts* rather than from metadata: which tokens end
generation (EOG), and which "control-looking" tokens are forced to CONTROL, which makes its
special-token splitter match them in prompt text. We mirror those rules so that our tokenizer and
our stop set agree with llama.cpp on the same file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import SourceError

# tokenizer.ggml.token_type values (llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# fmt: off
# Token texts llama.cpp treats as end-of-generation, whatever their stored type.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})

# Roles llama.cpp auto-detects by text when the metadata does not give the id: (metadata keys, texts,
# whether the role's token also ends generation). The detected token is forced to CONTROL.
DETECTED_ROLES: tuple[tuple[tuple[str, ...], frozenset[str], bool], ...] = (
    (("eot_token_id",), frozenset({
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    }), True),
    (("eom_token_id",), frozenset({"<|eom_id|>"}), True),
    (("fim_pre_token_id", "prefix_token_id"), frozenset({
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
    }), False),
    (("fim_suf_token_id", "suffix_token_id"), frozenset({
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
    }), False),
    (("fim_mid_token_id", "middle_token_id"), frozenset({
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    }), False),
    (("fim_pad_token_id",), frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}), True),
    (("fim_rep_token_id",), frozenset({
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    }), True),
    (("fim_sep_token_id",), frozenset({"<|file_sep|>"}), True),
)

# tokenizer.ggml.pre values whose llama.cpp defaults turn add_bos on (the llama3 and tekken families).
_PRE_ADDS_BOS = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon",
})
# fmt: on


@dataclass(frozen=True)
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) | "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: tuple[str, ...]
    types: tuple[int, ...]  # token types after llama.cpp's control-looking overrides
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None  # "left right", rank order
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    eog_ids: tuple[int, ...]  # every token that ends generation, EOS first
    add_bos: bool
    add_space_prefix: bool

    def is_special(self, token_id: int) -> bool:
        """Whether llama.cpp splits this token out of prompt text before running the tokenizer model."""
        return self.types[token_id] in (CONTROL, USER_DEFINED, UNKNOWN)


def read_vocab(meta: Mapping[str, Any]) -> Vocab:
    """The vocabulary of a GGUF whose metadata values (``ReaderField.contents()``) are ``meta``."""
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise SourceError(f"unsupported tokenizer.ggml.model {model!r}; supported: gpt2, llama")
    tokens = _tokens(meta)
    n = len(tokens)
    types = list(_int_array(meta, "tokenizer.ggml.token_type", n) or [NORMAL] * n)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) < n:
        raise SourceError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if model == "gpt2" and merges is None:
        raise SourceError("byte-level BPE vocabulary without tokenizer.ggml.merges")

    spm = model == "llama"
    # llama.cpp's per-model defaults, used when the metadata does not name the id (or names one out of range).
    bos_id = _token_id(meta, "bos_token_id", 1 if spm else 11, n)
    eos_id = _token_id(meta, "eos_token_id", 2 if spm else 11, n)
    unk_id = _token_id(meta, "unknown_token_id", 0 if spm else None, n)

    index = {t: i for i, t in enumerate(tokens)}
    eog: set[int] = set()
    for keys, texts, ends in DETECTED_ROLES:
        found = next((_token_id(meta, k, None, n) for k in keys if f"tokenizer.ggml.{k}" in meta), None)
        if found is None:
            # llama.cpp takes the first match in hash order; the lowest id is our deterministic stand-in.
            matches = sorted(index[t] for t in texts if t in index)
            if matches:
                found = matches[0]
                types[found] = _as_control(types[found])
        if found is not None and ends:
            eog.add(found)
    for text, i in index.items():
        if text in EOG_TEXTS:
            eog.add(i)
            types[i] = _as_control(types[i])
    if eos_id is not None:
        eog.add(eos_id)

    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm or pre in _PRE_ADDS_BOS))
    return Vocab(
        model=model,
        pre=pre,
        tokens=tokens,
        types=tuple(types),
        scores=tuple(float(s) for s in scores) if scores is not None else None,
        merges=tuple(merges) if merges is not None else None,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=unk_id,
        eog_ids=tuple(sorted(eog, key=lambda i: (i != eos_id, i))),
        add_bos=add_bos,
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
    )


def _tokens(meta: Mapping[str, Any]) -> tuple[str, ...]:
    raw = meta.get("tokenizer.ggml.tokens")
    if not raw:
        raise SourceError("no tokenizer.ggml.tokens: the checkpoint has no vocabulary")
    # llama.cpp renames empty tokens so that every text maps to one id.
    tokens = tuple(t if t else f"[EMPTY_{i}]" for i, t in enumerate(raw))
    if len(set(tokens)) != len(tokens):
        raise SourceError("tokenizer.ggml.tokens has duplicate token texts")
    return tokens


def _int_array(meta: Mapping[str, Any], key: str, n: int) -> list[int] | None:
    values = meta.get(key)
    if values is None:
        return None
    if len(values) < n:
        raise SourceError(f"{key} has {len(values)} entries for {n} tokens")
    return [int(v) for v in values[:n]]


def _token_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None and 0 <= int(value) < n:
        return int(value)
    return default if default is not None and default < n else None


def _as_control(token_type: int) -> int:
    # llama.cpp ORs the CONTROL attribute in, and any token with it set is split out of prompt text.
    return token_type if token_type in (CONTROL, USER_DEFINED, UNKNOWN) else CONTROL
