"""Fake engines for the server's tests: the Engine interface without TVM or a checkpoint.

`ScriptedEngine` replies with fixed token pieces (so stop strings, logprobs and usage have exact
expected values); a `gate` holds it in "prefill" until the test opens it, which is how the
queueing, keep-alive, cancellation and unload tests control timing. `SampledEngine` draws its
tokens through the real runtime sampler over fixed pseudo-random logits, to check seeds end to end.
`FakeEncoder` stands in for runtime.encoder.Encoder (/v1/embeddings).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from goinfer.runtime import prompt
from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.runtime.sampler import Sampler, SamplingParams
from goinfer.serve.engine import ModelInfo

PIECES = ("Hel", "lo", " wor", "ld", "!")


def render(messages: list[dict[str, Any]]) -> str:
    """The fake chat template: one `<role>content` per message, then the generation prompt."""
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class _Base:
    def __init__(self, context_window: int = 64, vocab_size: int = 1000):
        self.info = ModelInfo(
            path="fake.giw",
            quant="f32",
            target="fake",
            context_window=context_window,
            decode_path="fake decode",
            prefill_path="fake prefill",
            family="fake",
            vocab_size=vocab_size,
        )
        self.messages: list[dict[str, Any]] | None = None
        self.params: list[SamplingParams] = []
        self.requests: list[GenerationRequest] = []
        self.prompts: list[list[int]] = []  # in the order generations started
        self.started = threading.Event()  # a generation reached the engine
        self.finished = threading.Event()  # a generation's iterator was closed or ran out
        self.yielded = 0
        self.closed = False

    grammar = None  # no grammar-constrained decoding (GrammarEngine has it)

    def chat_ids(self, messages: list[dict[str, Any]], **template_vars: Any) -> list[int]:
        self.messages, self.template_vars = messages, template_vars
        return self.text_ids(render(messages))

    def text_ids(self, text: str) -> list[int]:
        return [ord(c) % self.info.vocab_size for c in text]  # one token per character

    def generate_choices(
        self, requests: list[GenerationRequest], cancel: threading.Event | None = None
    ) -> list[Iterator[StepEvent]]:
        return [self.generate(r, cancel) for r in requests]  # type: ignore[attr-defined]

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.closed = True


class ScriptedEngine(_Base):
    def __init__(
        self,
        pieces: Sequence[str] = PIECES,
        *,
        context_window: int = 64,
        step_s: float = 0.0,
        gate: threading.Event | None = None,
        fail: bool = False,
    ):
        super().__init__(context_window)
        self.pieces = tuple(pieces)
        self.vocab = sorted(set(self.pieces))
        self.step_s, self.gate, self.fail = step_s, gate, fail

    def token_text(self, token_id: int) -> str:
        return self.vocab[token_id]

    def logprob(self, i: int) -> float:
        return -0.25 * (i + 1)

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        assert request.constraint is None, "ScriptedEngine has no grammar: the server must not constrain it"
        prompt_ids, params, logprobs = list(request.prompt_ids), request.sampling, request.logprobs
        self.requests.append(request)
        self.params.append(params)
        self.prompts.append(list(prompt_ids))
        self.started.set()
        try:
            if self.gate is not None:
                self.gate.wait(timeout=30)  # a long prefill, until the test lets it finish
            if self.fail:
                raise RuntimeError("kernel exploded at /secret/path.py line 3")
            budget = request.budget(self.info.context_window)
            for i, piece in enumerate(self.pieces):
                if i >= budget:
                    yield StepEvent(None, "", None, "length")
                    return
                time.sleep(self.step_s)
                tid = self.vocab.index(piece)
                self.yielded += 1
                if logprobs is None:  # like Model.generate: none unless asked for
                    yield StepEvent(tid, piece)
                    continue
                alts = tuple((t, self.logprob(i) - t) for t in range(min(logprobs, len(self.vocab))))
                yield StepEvent(tid, piece, self.logprob(i), top_logprobs=alts)
            yield StepEvent(None, "", None, "stop")  # the model's end-of-sequence token
        finally:
            self.finished.set()


class SampledEngine(_Base):
    """Tokens drawn by runtime.sampler.Sampler from fixed logits: a seed must reproduce a reply."""

    WORDS = tuple(f" w{i}" for i in range(32))

    def __init__(self, length: int = 24):
        super().__init__()
        self.length = length
        self.logits = np.random.default_rng(0).normal(size=(length, len(self.WORDS)))

    def token_text(self, token_id: int) -> str:
        return self.WORDS[token_id]

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        assert request.constraint is None
        sampler = Sampler(request.sampling)
        for step in range(min(self.length, request.budget(self.info.context_window))):
            tok = sampler(self.logits[step])
            yield StepEvent(tok, self.WORDS[tok], -1.0)
        yield StepEvent(None, "", None, "length")


SPECIAL = ("<eos>",)
ADDED = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@functools.lru_cache(maxsize=1)
def byte_tokenizer_json() -> str:
    """A real tokenizers JSON: one token per byte (byte-level BPE, no merges), a few multi-byte
    words, the tool-call openers as added tokens (as Qwen has them) and an <eos>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for word in ("Ġthe", "Ġweather", "Ġis", "Ġsunny", "name", "arguments"):
        vocab[word] = len(vocab)
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]
    vocab.update({"Ġt": len(vocab), "Ġth": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    return tok.to_str()


class GrammarEngine(_Base):
    """A fake model over a real tokenizer and the real decode loop (runtime.decode), so grammar
    masks, tool-call constraints and confidence capture run exactly as on a bundle.

    Its logits follow `script` (the text it "wants" to write, one best-matching token at a time)
    with seeded noise; where a grammar forbids the script's token, the noise picks a legal one.
    """

    def __init__(
        self,
        script: str = "Hello!",
        context_window: int = 4096,
        noise: float = 1.0,
        seed: int = 0,
        step_s: float = 0.0,
    ):
        from goinfer.runtime.grammar import GrammarTokenizer
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(byte_tokenizer_json())
        vocab = self.tok.get_vocab_size()
        super().__init__(context_window, vocab)
        self.eos = self.tok.token_to_id("<eos>")
        self.grammar = GrammarTokenizer(byte_tokenizer_json(), vocab, [self.eos]).start()
        self.script, self.noise, self.seed, self.step_s = script, noise, seed, step_s
        self.texts = [self.tok.decode([i], skip_special_tokens=False) for i in range(vocab)]
        self.token_chars = prompt.longest_token(self.tok)
        self.constrained: list[bool] = []

    def text_ids(self, text: str) -> list[int]:
        # As a real model's: GIL released, a prompt that cannot fit refused before it is tokenized in full.
        ids = prompt.encode_within(self.tok, text, self.info.context_window, self.token_chars)
        return ids or [0]

    def token_text(self, token_id: int) -> str:
        return self.texts[token_id]

    def _logits(self, pos: int, rng: np.random.Generator) -> np.ndarray:
        z = rng.normal(size=len(self.texts)) * self.noise
        rest = self.script[pos:]
        if not rest:
            z[self.eos] += 20.0
            return z.astype(np.float32)
        best = max(
            (i for i, t in enumerate(self.texts) if t and rest.startswith(t) and i != self.eos),
            key=lambda i: len(self.texts[i]),
        )
        z[best] += 20.0
        return z.astype(np.float32)

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        from goinfer.runtime.decode import Detokenizer, sample_tokens

        prompt_ids, params, constraint = list(request.prompt_ids), request.sampling, request.constraint
        self.requests.append(request)
        self.params.append(params)
        self.constrained.append(constraint is not None)
        rng = np.random.default_rng(self.seed)
        pos = 0

        def step(tok: int) -> np.ndarray:
            nonlocal pos
            time.sleep(self.step_s)  # a decode step's time on a real model
            if self.script.startswith(self.texts[tok], pos):  # on script; off it, it still wants the rest
                pos += len(self.texts[tok])
            return self._logits(pos, rng)

        budget = request.budget(self.info.context_window)
        detok = Detokenizer(self.tok, prompt_ids)  # as Model.generate: whole characters only
        for ev in sample_tokens(
            self._logits(0, rng),
            step,
            budget,
            params,
            frozenset([self.eos]),
            detok.push,
            request.logprobs,
            constraint,
            request.capture,
        ):
            yield ev if ev.token_id is not None else StepEvent(None, detok.flush(), None, ev.finish_reason)


class ScoringEngine(ScriptedEngine):
    """Answers /v1/systemone: `score` gives logits that favour the letter `favour` names for each
    prompt (by a substring of the prompt), so a test knows the answer; `label_ids` are the letters'
    own character codes, as `text_ids` spells them."""

    def __init__(self, favour: dict[str, str] | None = None, margin: float = 2.0, context_window: int = 4096):
        super().__init__()
        self.info = dataclasses.replace(self.info, decisions=True, context_window=context_window)
        self.favour, self.margin = favour or {}, margin
        self.scored: list[list[int]] = []

    def score(self, prompt_ids: list[int], cancel: threading.Event | None = None) -> tuple[np.ndarray, int]:
        self.scored.append(list(prompt_ids))
        text = "".join(chr(i) for i in prompt_ids)
        logits = np.zeros(self.info.vocab_size, np.float32)
        for needle, letter in self.favour.items():
            if needle in text:
                logits[ord(letter) % self.info.vocab_size] += self.margin
        shared = 0 if len(self.scored) < 2 else _common(self.scored[-2], prompt_ids)
        return logits, shared

    def label_ids(self, labels: list[str]) -> list[int]:
        return [ord(label.strip()[0]) % self.info.vocab_size for label in labels]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# The seed's /v1/systemone example request (its model named by each test)
DECISIONS_EXAMPLE = {
    "model": "local",
    "state": "Help! My payouts have been failing for 3 days.",
    "questions": {
        "department": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {
                "billing": "Payments, invoicing, refunds",
                "technical": "Bugs, outages",
                "sales": None,
            },
        },
        "is_urgent": {"type": "noul", "instructions": "Is this urgent?"},
    },
}


class FakeEncoder:
    """runtime.encoder.Encoder's interface without TVM: one token a character between [CLS] (1) and
    [SEP] (2), and as the vector the mean of a fixed random vector per token id, L2-normalized (a
    hashed bag of tokens). Real vectors, deterministic, and a row never depends on its batch.

    `hold` given keeps each embed_ids call waiting until the test sets it (the batching tests);
    `calls` records every call's inputs; an input holding the id `poison` makes the call raise."""

    CLS, SEP = 1, 2

    def __init__(
        self,
        dimensions: int = 16,
        max_tokens: int = 32,
        prompts: dict[str, str] | None = None,
        vocab_size: int = 500,
        hold: threading.Event | None = None,
        poison: int | None = None,
    ):
        self.dimensions, self.max_tokens, self.pooling = dimensions, max_tokens, "mean"
        self.prompts = dict(prompts or {})
        self.spec = types.SimpleNamespace(family="bert", vocab_size=vocab_size)
        self.manifest = types.SimpleNamespace(quant="f32", family="bert")
        self.device, self.tier, self.load_seconds, self.self_test = "cpu", "fake", 0.01, None
        self.table = np.random.default_rng(0).standard_normal((vocab_size, dimensions)).astype(np.float32)
        self.hold, self.poison = hold, poison
        self.calls: list[list[list[int]]] = []
        self.entered = threading.Event()  # a call has started (and waits on `hold`, if given)
        self.closed = False

    def tokenize(self, text: str) -> list[int]:
        return [self.CLS] + [4 + ord(c) % (self.spec.vocab_size - 4) for c in text] + [self.SEP]

    def truncate(self, ids: list[int]) -> list[int]:
        return ids if len(ids) <= self.max_tokens else [*ids[: self.max_tokens - 1], ids[-1]]

    def vector(self, ids: list[int]) -> np.ndarray:
        """One input's vector, as embed_ids computes it."""
        v = self.table[ids].mean(axis=0)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def embed_ids(self, inputs: list[list[int]]) -> np.ndarray:
        self.calls.append([list(ids) for ids in inputs])
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(timeout=30)
        for ids in inputs:
            if not ids or len(ids) > self.max_tokens:
                raise ValueError(f"an input of {len(ids)} tokens (1 to {self.max_tokens})")
            if self.poison in ids:
                raise RuntimeError("kernel exploded at /secret/path.py line 3")
        return np.stack([self.vector(ids) for ids in inputs])

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.embed_ids([self.tokenize(t) for t in texts])

    def close(self) -> None:
        self.closed = True


NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
