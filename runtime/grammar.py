"""Grammar-constrained decoding with llguidance: a mask over the vocabulary at every step.

- `GrammarTokenizer` wraps the bundle's tokenizers JSON for llguidance. Building it walks the whole
  vocabulary (~1.7 s for Qwen's 152k tokens), so a model builds it once, in the background.
- `json_schema_grammar` turns a JSON schema into a grammar string; `GrammarTokenizer.matcher`
  compiles a grammar with the tokenizer and refuses a bad one with a message (the server's 400,
  sent before any prefill). A compiled matcher is cached per grammar; each request runs on a copy
  of it (~10 µs). `compile_json_schema` / `compile_lark` check a grammar without a tokenizer.
- `Constraint` is what the decode loop talks to: `allowed()` (a boolean mask, or None while
  unconstrained), `advance(token)`, `finished`. `GrammarConstraint` masks from the first token;
  `TriggeredConstraint` lets the model write freely until it emits an opener (a tool-call tag),
  then constrains what follows: a reply that never opens one decodes exactly as without it.

Measured on Qwen2.5-0.5B's vocabulary: a mask takes 20–300 µs (1.7 ms the first time a free string
is entered), next to a ~30 ms decode step.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .satisfiable import why_unsatisfiable

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("goinfer.grammar")

# Compact, fixed separators: with free whitespace a small model can pad a reply with newlines
# until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Lenient: a keyword llguidance does not implement (propertyNames, not, if/then, uniqueItems,
# contains, dependentRequired, dependentSchemas, unevaluatedProperties, an unknown format) is
# ignored with a warning instead of failing the schema. What it would have forbidden can then be
# generated: the reply stays valid for the schema without that keyword.
LENIENT_OPTIONS = {**JSON_OPTIONS, "lenient": True}


def _llg():
    """llguidance, imported on first use: ~50 ms that a cold start without a grammar skips."""
    import llguidance

    return llguidance


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says why."""


def json_schema_grammar(schema: dict[str, Any] | bool, lenient: bool = False) -> str:
    """A JSON schema -> an llguidance grammar, not compiled yet (see `GrammarTokenizer.matcher`).
    Strict (the default), a keyword the grammar cannot enforce fails it; lenient, it is ignored."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    why = why_unsatisfiable(schema)
    if why is not None:
        raise GrammarError(f"no finite JSON value satisfies it: {why}")
    options = LENIENT_OPTIONS if lenient else JSON_OPTIONS
    try:
        return _llg().LLMatcher.grammar_from_json_schema(closed(schema), defaults=options)
    except (ValueError, RecursionError) as e:
        raise GrammarError(str(e) or "it nests too deeply") from None


def compile_json_schema(schema: dict[str, Any] | bool, lenient: bool = False) -> str:
    """A JSON schema -> an llguidance grammar, validated without a tokenizer. Cached by the schema's
    text: an agent sends the same tools with every request."""
    try:
        key = json.dumps(schema, allow_nan=False)  # key order kept: properties are generated in it
    except (TypeError, ValueError):  # not JSON (NaN); the compiler has its say, uncached
        return _validated(json_schema_grammar(schema, lenient))
    except RecursionError:
        raise GrammarError("it nests too deeply") from None
    return _compiled(key, lenient)


@functools.lru_cache(maxsize=512)
def _compiled(schema_text: str, lenient: bool) -> str:
    return _validated(json_schema_grammar(json.loads(schema_text), lenient))


def closed(schema: Any, inside_all_of: bool = False) -> Any:
    """The schema with each object that lists its properties, and says nothing of others, closed to
    them. Every reply stays valid for the schema as given, but a small model can no longer append
    invented keys until max_tokens runs out (Gemma 3 270M did, on a one-field schema). Branches of
    an allOf stay open: closing them would make the intersection unsatisfiable."""
    if isinstance(schema, list):
        return [closed(s, inside_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "not", "additionalProperties", "contains"):
            out[key] = closed(value)
        elif key == "allOf":
            out[key] = closed(value, inside_all_of=True)
        else:
            out[key] = value
    opened = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not inside_all_of and not any(k in out for k in opened):
        out["additionalProperties"] = False
    return out


def compile_lark(lark: str) -> str:
    return _validated(_llg().LLMatcher.grammar_from_lark(lark))


def lark_literal(text: str, tok: llguidance.LLTokenizer | None = None) -> str:
    """`text` as a lark expression. With a tokenizer, pieces that are special tokens for it (a
    tool-call tag often is) become token references `<[id]>`: no quoted string can match those."""
    if not text:
        return ""
    if tok is None:
        return json.dumps(text)
    parts: list[str] = []
    run = b""
    for t in tok.tokenize_str(text):
        if tok.is_special_token(t):
            if run:
                parts.append(json.dumps(run.decode("utf-8", "replace")))
                run = b""
            parts.append(f"<[{t}]>")
        else:
            run += tok.decode_bytes([t])
    if run:
        parts.append(json.dumps(run.decode("utf-8", "replace")))
    return " ".join(parts)


def json_in_lark(schema: dict[str, Any]) -> str:
    """A JSON schema as a lark rule body (`%json{...}`), closed (see `closed`), with our separators,
    lenient: it is a tool's arguments (see `LENIENT_OPTIONS`). Check the schema with
    `compile_json_schema` first: this only spells it."""
    return "%json" + json.dumps({**closed(schema), "x-guidance": LENIENT_OPTIONS}, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def _validated(grammar: str) -> str:
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(_first_line(messages[0]))
    for message in messages:
        for keyword in ignored_keywords(message):
            _note_ignored(keyword)
    return grammar


def ignored_keywords(warning: str) -> list[str]:
    """What a lenient compile's warning says it ignored: each keyword, or the warning itself."""
    head, _, rest = warning.partition(":")
    if head.strip() == "Unimplemented keys":
        try:
            return [f"keyword {k!r}" for k in json.loads(rest)]
        except ValueError:
            pass
    if head.strip() == "Unknown format":
        return [f"format {rest.strip()!r}"]
    return [warning.strip()]


@functools.cache
def _note_ignored(what: str) -> None:
    """Logged once per process per keyword (cached: a second call is a no-op)."""
    log.warning("JSON schema %s is not enforced: generation ignores it (lenient schema)", what)


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else "invalid grammar"


class GrammarTokenizer:
    """llguidance's view of a bundle's tokenizer, built on a background thread at most once."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._args = (tokenizer_json, vocab_size, sorted(stop_ids))
        self._tok: llguidance.LLTokenizer | None = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def start(self) -> GrammarTokenizer:
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True).start()
        return self

    def _build(self) -> None:
        try:
            text, n, stops = self._args
            self._tok = _llg().LLTokenizer(text, n_vocab=n, eos_token=stops)
        except Exception as e:  # surfaced to the first request that needs it
            self._error = e
        finally:
            self._ready.set()

    def get(self) -> llguidance.LLTokenizer:
        self.start()
        self._ready.wait()
        if self._tok is None:
            raise GrammarError(f"this model's tokenizer cannot drive a grammar: {self._error}")
        return self._tok

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`: a copy of the cached compiled one."""
        tok = self.get()
        with self._lock:
            base = self._matchers.get(grammar)
            if base is None:
                try:
                    base = _llg().LLMatcher(tok, grammar, log_level=0)
                except Exception as e:  # llguidance's own errors, whatever their class
                    raise GrammarError(_first_line(str(e))) from None
                if base.is_error():
                    raise GrammarError(_first_line(base.get_error()))
                if len(self._matchers) >= 64:
                    self._matchers.pop(next(iter(self._matchers)))
                self._matchers[grammar] = base
            return base.deep_copy()

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for `grammar`, its first step tried now: a grammar that fails there,
        or that admits only an empty reply, is refused before any token is generated."""
        c = GrammarConstraint(self.matcher(grammar), self.vocab_size)
        try:
            first = c.allowed()
        except Exception as e:  # ParserTooComplex and friends surface at the first mask
            raise GrammarError(_first_line(str(e))) from None
        stops = [t for t in self._args[2] if t < first.size]
        if int(first.sum()) == int(first[stops].sum()):  # nothing allowed but an end of text
            raise GrammarError("only an empty reply satisfies it")
        return c

    def decode_bytes(self, token_id: int) -> bytes:
        """A token's bytes, as the grammar sees them."""
        return self.get().decode_bytes([token_id])


class Constraint(Protocol):
    def allowed(self) -> np.ndarray | None:
        """Boolean mask over the vocabulary for the next token, or None when anything goes."""
        ...

    def advance(self, token_id: int) -> None: ...

    @property
    def finished(self) -> bool:
        """The grammar is complete: generation ends here."""
        ...


def _mask_of(matcher: llguidance.LLMatcher, vocab: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    mask = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.size)
    mask[:n] = bits[:n].astype(bool)
    return mask


class GrammarConstraint:
    """Every token is checked by the grammar, from the first one."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.m, self.vocab = matcher, vocab_size

    def allowed(self) -> np.ndarray:
        mask = _mask_of(self.m, self.vocab)
        if not mask.any():  # an error state (cannot happen when only masked tokens are fed)
            raise GrammarError(f"grammar dead end: {self.m.get_error() or 'no token is allowed'}")
        return mask

    def advance(self, token_id: int) -> None:
        if not self.m.consume_token(token_id):
            raise GrammarError(f"grammar refused token {token_id}: {self.m.get_error()}")

    @property
    def finished(self) -> bool:
        return self.m.is_stopped()


class TriggeredConstraint:
    """Free text until the generated bytes end with `opener` at a token boundary, then a grammar.

    `make` builds the grammar's constraint when the opener appears; `token_bytes` spells a token
    (the grammar tokenizer's `decode_bytes`). A reply that never writes the opener is never masked
    (same tokens, same speed as with no constraint).
    """

    def __init__(
        self, opener: str, make: Callable[[], GrammarConstraint], token_bytes: Callable[[int], bytes]
    ):
        self.opener, self.make, self.token_bytes = opener.encode(), make, token_bytes
        self.tail = b""  # the last few bytes written, enough to see the opener
        self.inner: GrammarConstraint | None = None

    def allowed(self) -> np.ndarray | None:
        return self.inner.allowed() if self.inner is not None else None

    def advance(self, token_id: int) -> None:
        if self.inner is not None:
            self.inner.advance(token_id)
            return
        self.tail = (self.tail + self.token_bytes(token_id))[-4 * len(self.opener) :]
        if self.tail.endswith(self.opener):
            self.inner = self.make()

    @property
    def finished(self) -> bool:
        return self.inner is not None and self.inner.finished


class PrefixedConstraint:
    """Fixed tokens first (a tool-call opener, which may be a special token no grammar text can
    spell), then `inner` from the next token on."""

    def __init__(self, prefix_ids: list[int], inner: GrammarConstraint, vocab_size: int):
        self.prefix, self.inner, self.vocab = list(prefix_ids), inner, vocab_size

    def allowed(self) -> np.ndarray:
        if self.prefix:
            mask = np.zeros(self.vocab, dtype=bool)
            mask[self.prefix[0]] = True
            return mask
        return self.inner.allowed()

    def advance(self, token_id: int) -> None:
        if self.prefix:
            self.prefix.pop(0)
        else:
            self.inner.advance(token_id)

    @property
    def finished(self) -> bool:
        return not self.prefix and self.inner.finished
