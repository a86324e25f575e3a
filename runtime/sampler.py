"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = order[: int(np.searchsorted(cum, p.top_p)) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())
