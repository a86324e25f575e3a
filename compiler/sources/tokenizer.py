"""A HuggingFace ``tokenizers`` Tokenizer built from a GGUF vocabulary, encoding as llama.cpp does.

Two shapes cover our families:

* ``gpt2`` (qwen2, SmolLM2): byte-level BPE with the stored merges, behind the pre-tokenizer regexes
  llama.cpp's ``llm_tokenizer_bpe`` uses for ``tokenizer.ggml.pre``.
* ``llama`` (gemma3): SentencePiece-style BPE over ``▁``-escaped text with byte fallback. GGUF keeps
  only piece scores, so the merges are derived from them: llama.cpp merges the adjacent pair whose
  joined piece has the highest score, which is BPE with merges ranked by that score.

Tokens llama.cpp splits out of the text before the model runs (CONTROL, USER_DEFINED, UNKNOWN) become
added tokens matched on the raw text. No post-processor: the runtime decides about BOS.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .base import SourceError
from .gguf_vocab import CONTROL, UNKNOWN, USER_DEFINED, Vocab

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe), applied in sequence.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# The checkpoints' own tokenizer.json regexes, which llama.cpp rewrites without \p{Lu}-style classes
# for its engine: Mistral Nemo's tekken, and o200k's (Phi-4-mini's "gpt-4o").
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (regexes, ignore_merges: a whole word that is a token skips the merges).
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{p: ((_GPT2,), False) for p in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4")},
    **{p: ((r"\p{N}", _GPT2), False) for p in ("smollm", "starcoder", "refact", "codeshell", "command-r")},
    **{p: ((_QWEN2,), False) for p in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{p: ((_LLAMA3,), True) for p in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    "tekken": ((_TEKKEN,), True),
    **{p: ((_GPT4O,), False) for p in ("gpt-4o", "llama4")},
}


def build_tokenizer_json(vocab: Vocab) -> str:
    """The serialized ``tokenizers`` Tokenizer for ``vocab``."""
    tok = _byte_level(vocab) if vocab.model == "gpt2" else _sentencepiece(vocab)
    _add_special_tokens(tok, vocab)
    return tok.to_str()


def _byte_level(vocab: Vocab) -> Tokenizer:
    if vocab.pre not in _PRE:
        raise SourceError(
            f"unsupported tokenizer.ggml.pre {vocab.pre!r}; supported: {', '.join(sorted(_PRE))}"
        )
    regexes, ignore_merges = _PRE[vocab.pre]
    merges = [_split_merge(m) for m in vocab.merges or ()]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab.tokens)},
            merges=merges,
            ignore_merges=ignore_merges,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character (a piece may start with one).
    pos = merge.find(" ", 1)
    if pos < 0:
        raise SourceError(f"malformed tokenizer.ggml.merges entry {merge!r}")
    return merge[:pos], merge[pos + 1 :]


def _sentencepiece(vocab: Vocab) -> Tokenizer:
    if vocab.scores is None:
        raise SourceError("SentencePiece vocabulary without tokenizer.ggml.scores")
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab.tokens)},
            merges=_merges_from_scores(vocab.tokens, vocab.scores),
            unk_token=unk,
            byte_fallback=True,
        )
    )
    steps: list[normalizers.Normalizer] = []
    if vocab.add_space_prefix:
        # Each stretch of text between special tokens gets the prefix, as in llama.cpp.
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    unsteps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        unsteps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(unsteps)
    return tok


def _merges_from_scores(tokens: tuple[str, ...], scores: tuple[float, ...]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best joined score first (ties: lower id first)."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in index and right in index:
                ranked.append((-scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(tok: Tokenizer, vocab: Vocab) -> None:
    special, plain = [], []
    for i, text in enumerate(vocab.tokens):
        if vocab.types[i] in (CONTROL, UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif vocab.types[i] == USER_DEFINED:
            plain.append(AddedToken(text, special=False, normalized=False))
    # The tokens are already in the model's vocabulary, so they keep their ids.
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
