"""Model families, one file each, registered by the architecture string of the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ..lower import tvm_api
from ..sources.base import SourceTensor
from ..spec import ModelSpec
from . import gemma3, llama, qwen2
from .decoder import CausalLM
from .layers import SchemePicker

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen2, "gemma3": gemma3}


def build_model(
    spec: ModelSpec,
    layer_cls: type,
    pick: SchemePicker,
    tensors: Mapping[str, SourceTensor],
    target: dict[str, Any],
) -> CausalLM:
    """The causal LM of `layer_cls` blocks, each weight in the scheme `pick` gives it."""
    return CausalLM(spec, layer_cls, pick, tensors, tvm_api.make_target(target))
