"""The .giw bundle format: writer, reader and summary (numpy and the standard library only)."""

from .giw import (
    DEFAULT_ALIGN,
    FORMAT_VERSION,
    MAGIC,
    Bundle,
    BundleError,
    BundleInfo,
    ModuleEntry,
    TensorEntry,
    describe,
    open_bundle,
    write_bundle,
)

__all__ = [
    "DEFAULT_ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "Bundle",
    "BundleError",
    "BundleInfo",
    "ModuleEntry",
    "TensorEntry",
    "describe",
    "open_bundle",
    "write_bundle",
]
