"""The .giw bundle format: the container (giw), its typed manifest, and the cache folders
(numpy and the standard library only)."""

from .giw import (
    DEFAULT_ALIGN,
    FORMAT_VERSION,
    MAGIC,
    Bundle,
    BundleError,
    BundleInfo,
    ModuleEntry,
    TensorEntry,
    open_bundle,
    write_bundle,
)
from .manifest import Manifest, ModelSpec, describe

__all__ = [
    "DEFAULT_ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "Bundle",
    "BundleError",
    "BundleInfo",
    "Manifest",
    "ModelSpec",
    "ModuleEntry",
    "TensorEntry",
    "describe",
    "open_bundle",
    "write_bundle",
]
