"""Checkpoint sources: each turns a checkpoint into a `Checkpoint` (spec, tokenizer, template, tensors)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .base import Checkpoint, SourceError


def load_checkpoint(ref: str | Path) -> Checkpoint:
    """A GGUF file (any shard of a split one), a checkpoint directory (config.json, tokenizer and
    safetensors), an ``hf:owner/repo:QUANT`` reference (pulled once into the cache) or a zoo name."""
    from . import gguf_file, hf_dir, zoo

    path = zoo.resolve(str(ref))
    ckpt = hf_dir.load_dir(path) if path.is_dir() else gguf_file.load_gguf(path)
    # A pulled checkpoint keeps the reference it was asked for, not its place in the cache.
    return dataclasses.replace(ckpt, source=str(ref)) if str(ref).startswith("hf:") else ckpt


__all__ = ["Checkpoint", "SourceError", "load_checkpoint"]
