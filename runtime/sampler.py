"""Next-token choice from logits: pure functions over a numpy row, plus a small stateful Sampler.

- temperature 0 is greedy (argmax; ties go to the lowest token id).
- Plain temperature (no top_k / top_p / min_p) draws by Gumbel-max: argmax(logits/T + G) with the
  noise G from a counter-based Philox generator keyed by (seed, draw index). Draw i of a seed is
  the same whatever came before it, so a seed reproduces exactly.
- With a filter, the survivors are ordered by (probability desc, token id asc) and one uniform from
  the same generator picks along their cumulative mass. top_p's nucleus is measured over the FULL
  distribution and then intersected with the top-k set (not HF's renormalize-after-top-k).
- frequency/presence penalties act on the tokens this sampler has already chosen (OpenAI's rule).
- Before those, in vLLM's order: `logit_bias` (OpenAI's: added to the chosen ids' logits; a grammar's
  -inf stays -inf, so a bias never allows a token the grammar forbids), then `repetition_penalty`
  (vLLM's and llama.cpp's: a seen token's positive logit divided by it, a negative one multiplied,
  seen = in the prompt or already chosen). Without them the logits are not touched.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_KEY_MASK = (1 << 64) - 1
_DOMAIN = 0x676F696E66657221  # second Philox key word ("goinfer!"): our streams, not numpy's default


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh random seed per Sampler
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = 256  # None: the rest of the context window (GenerationRequest.budget)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    repetition_penalty: float = 1.0  # > 0; 1.0: off

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def draw_generator(seed: int, draw: int) -> np.random.Generator:
    """The generator for draw number `draw` of `seed`: Philox keyed by the seed, counter at the draw.

    Draw streams never overlap: numpy advances word 0 of the 256-bit counter, the draw sits in word 2.
    """
    key = np.array([seed & _KEY_MASK, _DOMAIN], dtype=np.uint64)
    counter = np.array([0, 0, draw & _KEY_MASK, 0], dtype=np.uint64)
    bits = np.random.Philox(key=key, counter=counter)
    return np.random.Generator(bits)


def gumbel_noise(seed: int, draw: int, n: int) -> np.ndarray:
    # -log(E) for E ~ Exp(1) is a standard Gumbel; the exponential sampler is cheaper than log(-log(U)).
    e = draw_generator(seed, draw).standard_exponential(n)
    return -np.log(np.maximum(e, np.finfo(np.float64).tiny))


def uniform(seed: int, draw: int) -> float:
    return float(draw_generator(seed, draw).random())


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # numpy returns the first maximum: the lowest id wins a tie


def apply_penalties(logits: np.ndarray, counts: np.ndarray, frequency: float, presence: float) -> np.ndarray:
    """OpenAI's rule: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    return logits - counts * frequency - (counts > 0) * presence


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """OpenAI's logit_bias: each id's bias added to its logit (a copy; -inf stays -inf)."""
    if not bias:
        return logits
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    out = logits.astype(np.float64)
    np.add.at(out, ids, np.fromiter((b for _, b in bias), dtype=np.float64, count=len(bias)))
    return out


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """vLLM's rule: where `seen`, a positive logit is divided by `penalty`, any other multiplied."""
    if penalty == 1.0:
        return logits
    z = logits.astype(np.float64)
    hit = z[seen]
    z[seen] = np.where(hit > 0, hit / penalty, hit * penalty)
    return z


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def ranked(probs: np.ndarray) -> np.ndarray:
    """Token ids by probability, highest first; equal probabilities by ascending id (stable sort)."""
    return np.argsort(-probs, kind="stable")


def top_ranked(probs: np.ndarray, m: int) -> np.ndarray:
    """The first `m` ids of `ranked(probs)`, without sorting the whole vocabulary."""
    if m >= probs.size:
        return ranked(probs)
    kth = np.partition(probs, probs.size - m)[probs.size - m]  # the m-th largest probability
    above = np.flatnonzero(probs > kth)
    tied = np.flatnonzero(probs == kth)[: m - above.size]  # a tie at the cut: lowest ids first
    cand = np.concatenate([above, tied])
    return cand[np.lexsort((cand, -probs[cand]))]


def _rank_prefix(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """A prefix of the ranking that holds every survivor: the top k, or enough mass for the nucleus,
    or everything over the min_p line; grown geometrically so a peaked distribution stays cheap."""
    if top_k > 0:
        return top_ranked(probs, top_k)
    if top_p < 1.0:
        m = 64
        while True:
            cand = top_ranked(probs, m)
            if m >= probs.size or probs[cand].sum() >= top_p:
                return cand
            m *= 4
    return top_ranked(probs, int(np.count_nonzero(probs >= min_p * probs.max())))


def survivors(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The tokens the filters keep, in rank order. Each filter is judged on the full distribution and
    the results are intersected; on a rank prefix that is just the shortest of the three cuts."""
    keep = _rank_prefix(probs, top_k, top_p, min_p)
    if 0 < top_k < keep.size:
        keep = keep[:top_k]
    if top_p < 1.0:
        # The prefix's running mass equals the full distribution's: the smallest prefix reaching top_p.
        keep = keep[: int(np.searchsorted(np.cumsum(probs[keep]), top_p)) + 1]
    if min_p > 0.0:
        keep = keep[probs[keep] >= min_p * probs[keep[0]]]
    return keep  # never empty: the top token passes every filter


def filtered_choice(probs: np.ndarray, keep: np.ndarray, u: float) -> int:
    """Walk the survivors in rank order and stop where their cumulative mass passes u * total."""
    cum = np.cumsum(probs[keep])
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(keep[min(i, keep.size - 1)])


def sample(logits: np.ndarray, p: SamplingParams, seed: int, draw: int) -> int:
    """One token from already-penalized logits: draw `draw` of `seed`."""
    if p.temperature <= 0:
        return greedy(logits)
    z = logits.astype(np.float64) / p.temperature
    if not p.filtered:
        return greedy(z + gumbel_noise(seed, draw, z.size))
    probs = softmax(z)
    keep = survivors(probs, p.top_k, p.top_p, p.min_p)
    return filtered_choice(probs, keep, uniform(seed, draw))


class Sampler:
    """Per-request state: the seed, the draw counter and the counts the penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self.counts: np.ndarray | None = None
        self.prompt_ids = prompt_ids  # what repetition_penalty counts as seen, with the chosen tokens
        self.seen: np.ndarray | None = None

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if self.counts is None:
            self.counts = np.zeros(logits.size, dtype=np.float64)
            if p.repetition_penalty != 1.0:
                self.seen = np.zeros(logits.size, dtype=bool)
                ids = np.asarray(self.prompt_ids, dtype=np.int64)
                self.seen[ids[(ids >= 0) & (ids < logits.size)]] = True
        # (no copy without these: `sample` converts what it needs; greedy needs nothing)
        z = apply_logit_bias(logits, p.logit_bias)
        if self.seen is not None:
            z = apply_repetition_penalty(z, self.seen, p.repetition_penalty)
        z = apply_penalties(z, self.counts, p.frequency_penalty, p.presence_penalty)
        tok = sample(z, p, self.seed, self.draws)
        self.draws += 1
        self.counts[tok] += 1
        if self.seen is not None:
            self.seen[tok] = True
        return tok
