"""Model families, one file each (`<family>.py`, with its LAYER), keyed by the checkpoint's
architecture string.

Importing this package does not import TVM: checkpoint sources refuse an unsupported family with
FAMILIES before anything is compiled, and `layer` imports a family's file when a build needs it.
"""

from __future__ import annotations

import importlib

FAMILIES = ("llama", "qwen2", "gemma3")


def layer(family: str) -> type:
    """The decoder layer class of `family` (one of FAMILIES)."""
    if family not in FAMILIES:
        raise KeyError(f"unsupported architecture {family!r}; supported: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{family}").LAYER
