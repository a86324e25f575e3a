"""Checkpoint sources: each turns a checkpoint into a `Checkpoint` (spec, tokenizer, template, tensors)."""

from __future__ import annotations

from pathlib import Path

from .base import Checkpoint, SourceError


def load_checkpoint(ref: str | Path) -> Checkpoint:
    """A GGUF path, or the name of a model in the zoo (fetched and verified on first use)."""
    from . import gguf_file, zoo

    path = Path(ref)
    if not path.exists():
        path = zoo.resolve(str(ref))
    if path.is_dir():
        raise SourceError(f"{path}: safetensors directories are not supported yet; give a .gguf file")
    return gguf_file.load_gguf(path)


__all__ = ["Checkpoint", "SourceError", "load_checkpoint"]
