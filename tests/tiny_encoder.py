"""Tiny encoder checkpoints, written as sentence-transformers folders the way the real ones are:
config.json (HF's keys for BertModel and NomicBertModel), tokenizer.json (a WordPiece vocabulary
with BERT's normalizer, pre-tokenizer and [CLS] ... [SEP] post-processor), model.safetensors with
HF's tensor names, modules.json and 1_Pooling/config.json, and for nomic_bert the task prompts
in config_sentence_transformers.json.

``write_tiny_encoder(path, family, pooling="mean")`` -> path. Random weights (seeded), sized so
every kernel path runs: hidden 64 (4 vectors of 16), 4 heads of 16, 2 layers, 32 positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

HIDDEN, HEADS, LAYERS, FFN, POSITIONS = 64, 4, 2, 96, 32
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (  # noqa: SIM905 (a sentence reads better than 90 quoted words)
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "def return import class self print list dict sort key value"
).split()
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
POOLING_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "last": "pooling_mode_lasttoken",
}


def vocab() -> list[str]:
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,:;!?()[]{}'\"-_=+*/<>#@")
    return SPECIALS + WORDS + ["search", "query", "document"] + chars + pieces


def tokenizer() -> Tokenizer:
    words = vocab()
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    return tok


def _weights(family: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape: int, scale: float = 0.15) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> tuple[np.ndarray, np.ndarray]:
        return (1 + w(HIDDEN, scale=0.1)), w(HIDDEN, scale=0.1)

    n, d, f = len(vocab()), HIDDEN, FFN
    out: dict[str, np.ndarray] = {}
    if family == "bert":
        g, b = norm()
        out |= {
            "embeddings.word_embeddings.weight": w(n, d, scale=0.5),
            "embeddings.position_embeddings.weight": w(POSITIONS, d, scale=0.5),
            "embeddings.token_type_embeddings.weight": w(2, d, scale=0.5),
            "embeddings.LayerNorm.weight": g,
            "embeddings.LayerNorm.bias": b,
            "embeddings.position_ids": np.arange(POSITIONS, dtype=np.int64)[None],  # unused, as saved
            "pooler.dense.weight": w(d, d),
            "pooler.dense.bias": w(d),
        }
        for i in range(LAYERS):
            p = f"encoder.layer.{i}"
            for name, rows, cols in (
                ("attention.self.query", d, d), ("attention.self.key", d, d), ("attention.self.value", d, d),
                ("attention.output.dense", d, d), ("intermediate.dense", f, d), ("output.dense", d, f),
            ):  # fmt: skip
                out[f"{p}.{name}.weight"], out[f"{p}.{name}.bias"] = w(rows, cols), w(rows, scale=0.05)
            for name in ("attention.output.LayerNorm", "output.LayerNorm"):
                out[f"{p}.{name}.weight"], out[f"{p}.{name}.bias"] = norm()
        return out
    g, b = norm()
    out |= {
        "embeddings.word_embeddings.weight": w(n, d, scale=0.5),
        "embeddings.token_type_embeddings.weight": w(2, d, scale=0.5),
        "emb_ln.weight": g,
        "emb_ln.bias": b,
    }
    for i in range(LAYERS):
        p = f"encoder.layers.{i}"
        out[f"{p}.attn.Wqkv.weight"] = w(3 * d, d)
        out[f"{p}.attn.out_proj.weight"] = w(d, d)
        out[f"{p}.mlp.fc11.weight"], out[f"{p}.mlp.fc12.weight"] = w(f, d), w(f, d)
        out[f"{p}.mlp.fc2.weight"] = w(d, f)
        out[f"{p}.norm1.weight"], out[f"{p}.norm1.bias"] = norm()
        out[f"{p}.norm2.weight"], out[f"{p}.norm2.bias"] = norm()
    return out


def config(family: str) -> dict:
    n = len(vocab())
    if family == "bert":
        return {
            "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
            "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
            "intermediate_size": FFN, "max_position_embeddings": POSITIONS, "layer_norm_eps": 1e-12,
            "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": n,
        }  # fmt: skip
    return {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
        "n_embd": HIDDEN, "n_head": HEADS, "n_layer": LAYERS, "n_inner": FFN, "n_positions": POSITIONS,
        "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
        "mlp_fc2_bias": False, "prenorm": False, "type_vocab_size": 2, "vocab_size": n,
    }  # fmt: skip


def write_tiny_encoder(path: Path, family: str, pooling: str = "mean", seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config(family), indent=1))
    tokenizer().save(str(path / "tokenizer.json"))
    save_file(_weights(family, np.random.default_rng(seed)), str(path / "model.safetensors"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": HIDDEN} | {
        key: key == POOLING_KEYS[pooling] for key in POOLING_KEYS.values()
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if family == "nomic_bert":
        (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return path
