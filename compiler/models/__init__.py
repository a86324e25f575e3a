"""Model families, one file each, registered by the architecture string of the checkpoint."""

from __future__ import annotations

from types import ModuleType

from . import gemma3, llama, qwen2

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen2, "gemma3": gemma3}
