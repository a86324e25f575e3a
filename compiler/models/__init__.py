"""Model families, one file each (`<family>.py`, with its LAYER and its KIND), keyed by the
checkpoint's architecture string (artifacts/manifest.py's FAMILIES).

A family's KIND names the graph its layers build into (`<kind>.py`: `decoder`, `encoder`) and the
entry points its bundle's module has (manifest.ENTRY_POINTS_OF): the build reads both from the
declaration, never from the family's name.

Importing this package does not import TVM: `family` imports a family's file when a build needs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from goinfer.artifacts.manifest import ENTRY_POINTS_OF, FAMILIES

__all__ = ["FAMILIES", "Family", "family", "layer"]


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "decoder" | "encoder"
    layer: type  # one block of the model

    @property
    def entry_points(self) -> tuple[str, ...]:
        return ENTRY_POINTS_OF[self.kind]

    def build(self, spec, pick, tensors, target: dict[str, Any], kv_dtype: str, **kind_options: Any):
        """The family's whole model (its kind's graph over its layers), weights not yet packed;
        `kind_options`: what that graph takes beyond them (an encoder's pooling)."""
        graph = importlib.import_module(f"{__name__}.{self.kind}")
        return graph.build_model(spec, self.layer, pick, tensors, target, kv_dtype, **kind_options)


def family(name: str) -> Family:
    """The family `name` (one of FAMILIES) as its file declares it."""
    if name not in FAMILIES:
        raise KeyError(f"unsupported architecture {name!r}; supported: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    if module.KIND not in ENTRY_POINTS_OF:
        raise KeyError(f"family {name!r} declares kind {module.KIND!r}; known: {', '.join(ENTRY_POINTS_OF)}")
    return Family(name, module.KIND, module.LAYER)


def layer(name: str) -> type:
    """The layer class of family `name`."""
    return family(name).layer
