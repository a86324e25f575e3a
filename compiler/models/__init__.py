"""Model families, one file each (`<family>.py`, with its LAYER and its KIND), keyed by the
checkpoint's architecture string (artifacts/manifest.py's FAMILIES).

A family's KIND names the graph its layers build into (`<kind>.py`: today `decoder`) and the
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
    kind: str  # "decoder" (an encoder family, "encoder")
    layer: type  # one block of the model

    @property
    def entry_points(self) -> tuple[str, ...]:
        return ENTRY_POINTS_OF[self.kind]

    def build(self, spec, pick, tensors, target: dict[str, Any], kv_dtype: str):
        """The family's whole model (its kind's graph over its layers), weights not yet packed."""
        graph = importlib.import_module(f"{__name__}.{self.kind}")
        return graph.build_model(spec, self.layer, pick, tensors, target, kv_dtype)


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
