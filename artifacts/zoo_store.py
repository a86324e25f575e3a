"""A zoo store: pre-built bundles in one folder, content-addressed by their inputs, and its index.

    DIR/index.json              {"format": 1, "bundles": [Entry, ...]}, sorted by name
    DIR/bundles/<key>.giw       one bundle per (source, quant, target, compiler, TVM) key

`goinfer zoo build` (compiler side) writes it; `goinfer serve --model zoo:DIR/NAME` reads it
without building, so this module is the store's one reader and writer. A bundle's key is a hash
of everything it was built from, so a cell whose key is in the index and whose file verifies is
already built, on any machine that shares the folder (a CI cache restores it by that key).
Standard library only, like the rest of artifacts/.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .cache import sha256_file

INDEX = "index.json"
FORMAT = 1
BUNDLES = "bundles"


class StoreError(ValueError):
    """An unreadable store or index, or a name that matches nothing in it (one line)."""


@dataclass(frozen=True)
class Entry:
    name: str  # what serve --model zoo:DIR/NAME asks for: "<model>.<quant>.<targets>"
    model: str  # the zoo name, or the reference the source was given as
    quant: str
    target: str  # "llvm", "cuda", or several: "llvm,cuda"
    kv_dtype: str
    key: str  # the hash of the inputs (source sha256, options, compiler fingerprint, TVM version)
    path: str  # relative to the store folder
    sha256: str  # of the bundle file
    size: int
    source: str  # the source reference
    source_sha256: str

    @classmethod
    def from_json(cls, obj: object, where: str) -> Entry:
        names = [f.name for f in fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names):
            raise StoreError(f"{where}: an index entry must have exactly the keys {', '.join(names)}")
        entry = cls(**obj)
        if Path(entry.path).is_absolute() or ".." in Path(entry.path).parts:
            raise StoreError(f"{where}: entry {entry.name} has a path outside the store: {entry.path}")
        return entry


def entry_name(model: str, quant: str, target: str) -> str:
    return f"{model}.{quant}.{target.replace(',', '+')}"


def bundle_relpath(key: str) -> str:
    return f"{BUNDLES}/{key}.giw"


def index_path(store: str | os.PathLike[str]) -> Path:
    """The index of a store folder, or the index file itself when given one."""
    p = Path(store)
    return p if p.name == INDEX or p.is_file() else p / INDEX


def read_index(store: str | os.PathLike[str]) -> list[Entry]:
    """The entries of a store (a folder or its index.json); an absent index is an empty store."""
    path = index_path(store)
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:  # its message holds the byte: say what is wrong, not what is there
        raise StoreError(f"{path}: unreadable zoo index: not UTF-8 text (at byte {e.start})") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: unreadable zoo index: {e}") from None
    bundles = body.get("bundles") if isinstance(body, dict) else None
    if not isinstance(bundles, list) or body.get("format") != FORMAT:
        raise StoreError(f"{path}: not a zoo index of format {FORMAT}")
    return [Entry.from_json(e, str(path)) for e in bundles]


def write_index(store: str | os.PathLike[str], entries: Iterable[Entry]) -> Path:
    """Write the index atomically (a temp file renamed), entries sorted by name: byte-stable."""
    folder = Path(store)
    folder.mkdir(parents=True, exist_ok=True)
    unique: dict[str, Entry] = {}
    for e in entries:
        if e.name in unique and unique[e.name] != e:
            raise StoreError(f"two different bundles are named {e.name} (keys {unique[e.name].key}, {e.key})")
        unique[e.name] = e
    body = {"format": FORMAT, "bundles": [asdict(unique[n]) for n in sorted(unique)]}
    fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / INDEX)
    return folder / INDEX


def verified(store: str | os.PathLike[str], entry: Entry) -> bool:
    """True when the entry's bundle is in the store with its recorded size and sha256."""
    path = Path(store) / entry.path
    try:
        if path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    return sha256_file(path) == entry.sha256


def find(store: str | os.PathLike[str], name: str) -> tuple[Path, Entry]:
    """The bundle serve --model zoo:DIR/NAME means: the entry named NAME, or the one bundle of the
    model NAME (several: the gguf quant, then a CPU target, else the choice is the user's)."""
    folder = index_path(store).parent
    entries = read_index(store)
    if not entries:
        raise StoreError(f"{folder}: no zoo index here (build one with goinfer zoo build -o {folder})")
    chosen = [e for e in entries if e.name == name] or [e for e in entries if e.model == name]
    if len(chosen) > 1:
        chosen = [e for e in chosen if e.quant == "gguf"] or chosen
        chosen = [e for e in chosen if "llvm" in e.target.split(",")] or chosen
    if len(chosen) != 1:
        have = ", ".join(e.name for e in (chosen or entries))
        what = "matches several bundles" if chosen else "is not in the store"
        raise StoreError(f"zoo:{folder}/{name} {what}; name one of: {have}")
    (entry,) = chosen
    path = folder / entry.path
    if not path.is_file():
        raise StoreError(f"zoo:{folder}/{name}: the index lists {entry.path}, which is missing")
    return path, entry
