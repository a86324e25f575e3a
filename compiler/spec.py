"""ModelSpec: everything the lowering needs to know about a checkpoint, and nothing else.

A source (a GGUF, or a Hugging Face safetensors folder) fills one in; a model family reads it. It
is part of the bundle contract (the manifest keeps it verbatim), so it is defined in
goinfer.artifacts.manifest.
"""

from goinfer.artifacts.manifest import ModelSpec, RopeScaling

__all__ = ["ModelSpec", "RopeScaling"]
