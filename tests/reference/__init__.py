"""Independent numpy reference forward pass over a GGUF file (see README.md)."""

from .forward import SUPPORTED_ARCHS, HParams, attention_mask, load, reference_logits

__all__ = ["SUPPORTED_ARCHS", "HParams", "attention_mask", "load", "reference_logits"]
