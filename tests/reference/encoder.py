"""Numpy forwards of the encoder families, read straight from a Hugging Face folder (HF's tensor
names and config keys, not the compiler's source), in float64: what a bundle's vectors are
held to.

    vectors = embed(folder, [[101, 7592, 2088, 102], ...])   # (n, hidden), L2-normalized

The formulas are transformers' BertModel and nomic's NomicBertModel (post-norm), pooled as
sentence-transformers' Pooling + Normalize modules do (mean over the tokens, CLS, or last).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int) -> np.ndarray:
    t, width = q.shape
    d = width // heads
    q, k, v = (a.reshape(t, heads, d).transpose(1, 0, 2) for a in (q, k, v))
    s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(1, 0, 2).reshape(t, width)


def _rope(x: np.ndarray, heads: int, theta: float) -> np.ndarray:
    """Half-split rotary embedding (nomic's non-interleaved), positions 0..t-1."""
    t, width = x.shape
    d = width // heads
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x = x.reshape(t, heads, d)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1).reshape(t, width)


class Reference:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(folder / "model.safetensors").items()}
        self.pooling = _pooling(folder)

    def _lin(self, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if f"{name}.bias" in self.w else y

    def _ln(self, name: str, x: np.ndarray, eps: float) -> np.ndarray:
        return _layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], eps)

    def hidden(self, ids: list[int]) -> np.ndarray:
        c, w = self.config, self.w
        if c["model_type"] == "bert":
            eps, heads = c["layer_norm_eps"], c["num_attention_heads"]
            x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0]
            x = x + w["embeddings.position_embeddings.weight"][: len(ids)]
            x = self._ln("embeddings.LayerNorm", x, eps)
            for i in range(c["num_hidden_layers"]):
                p = f"encoder.layer.{i}"
                q, k, v = (self._lin(f"{p}.attention.self.{n}", x) for n in ("query", "key", "value"))
                a = self._lin(f"{p}.attention.output.dense", _attention(q, k, v, heads))
                x = self._ln(f"{p}.attention.output.LayerNorm", a + x, eps)
                h = self._lin(f"{p}.intermediate.dense", x)
                h = 0.5 * h * (1 + _erf(h / math.sqrt(2)))
                x = self._ln(f"{p}.output.LayerNorm", self._lin(f"{p}.output.dense", h) + x, eps)
            return x
        eps, heads, theta = c["layer_norm_epsilon"], c["n_head"], c["rotary_emb_base"]
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0]
        x = self._ln("emb_ln", x, eps)
        for i in range(c["n_layer"]):
            p = f"encoder.layers.{i}"
            q, k, v = np.split(self._lin(f"{p}.attn.Wqkv", x), 3, axis=-1)
            a = _attention(_rope(q, heads, theta), _rope(k, heads, theta), v, heads)
            x = self._ln(f"{p}.norm1", self._lin(f"{p}.attn.out_proj", a) + x, eps)
            up, gate = self._lin(f"{p}.mlp.fc11", x), self._lin(f"{p}.mlp.fc12", x)
            x = self._ln(f"{p}.norm2", self._lin(f"{p}.mlp.fc2", up * gate / (1 + np.exp(-gate))) + x, eps)
        return x

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = []
        for ids in inputs:
            h = self.hidden(ids)
            v = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[self.pooling]
            out.append(v / max(np.linalg.norm(v), 1e-12))
        return np.stack(out)


def _pooling(folder: Path) -> str:
    modules = folder / "modules.json"
    if not modules.is_file():
        return "mean"
    for m in json.loads(modules.read_text()):
        if m["type"].endswith(".Pooling"):
            cfg = json.loads((folder / m["path"] / "config.json").read_text())
            if cfg.get("pooling_mode_cls_token"):
                return "cls"
            if cfg.get("pooling_mode_lasttoken"):
                return "last"
    return "mean"


def embed(folder: str | Path, inputs: list[list[int]]) -> np.ndarray:
    return Reference(folder).embed(inputs)
