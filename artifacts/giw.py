"""The .giw bundle: one file holding the manifest, the weights and the compiled modules.

Writer and reader share this module so their byte order cannot drift; FORMAT.md beside it is
the spec. Only numpy and the standard library are used, so the runtime can load a bundle
without pulling in the compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from . import cache

MAGIC = b"\x89GIW\r\n\x1a\n"  # PNG-style: the high byte and CR/LF catch text-mode mangling
FORMAT_VERSION = 2  # 2: the typed manifest (manifest.py); older bundles are refused, to be rebuilt
DEFAULT_ALIGN = 4096  # page size: blobs map straight into the page cache
MIN_ALIGN = 64
MAX_ALIGN = 1 << 30
# magic, version, alignment, manifest length, file size; then sha256(those 32 bytes + manifest)
_FIELDS = struct.Struct("<8sIIQQ")
_HASHED_HEADER = _FIELDS.size  # 32: the checksum covers the fields before it, too
_HEADER = struct.Struct("<8sIIQQ32s")
HEADER_SIZE = _HEADER.size  # 64

# The dtypes a bundle may hold, as numpy's explicit little-endian dtype strings.
DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
RESERVED_KEYS = ("tensors", "modules")  # manifest keys the writer fills in
_CHUNK = 8 << 20
_PARALLEL_BYTES = 64 << 20
_MAX_NDIM = 32

Verify = Literal["full", "once", "none"]


class BundleError(ValueError):
    """A bundle that cannot be written, or that is refused at load; the message says why."""


@dataclass(frozen=True)
class BundleInfo:
    size: int
    sha256: str  # of the whole file


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file_offset: int  # absolute; the manifest stores it relative to the data section
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class ModuleEntry:
    key: str
    target: dict[str, Any]
    file_offset: int
    nbytes: int
    sha256: str


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _sha256_hex(data: Any) -> str:
    """The one place blob bytes are hashed (tests spy on it to prove a skipped re-hash)."""
    return hashlib.sha256(data).hexdigest()


def _hash_all(views: list[memoryview]) -> list[str]:
    # hashlib drops the GIL on large buffers, so threads use every core on big bundles.
    if sum(len(v) for v in views) < _PARALLEL_BYTES:
        return [_sha256_hex(v) for v in views]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256_hex, views))


def _dumps(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _raw_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------- writer


def _prepare_tensor(name: object, arr: object) -> tuple[str, np.ndarray]:
    if not isinstance(name, str) or not name:
        raise BundleError(f"tensor name must be a non-empty string, got {name!r}")
    a = np.asarray(arr)
    if a.ndim > _MAX_NDIM:
        raise BundleError(f"tensor '{name}' has {a.ndim} dimensions; at most {_MAX_NDIM} are supported")
    dt = a.dtype.newbyteorder("<")  # leaves single-byte types as "|"
    if dt.str not in DTYPES:
        raise BundleError(f"tensor '{name}' has unsupported dtype {a.dtype}")
    # Big-endian or strided inputs get one copy here; the common case is a no-copy view.
    a = a.astype(dt, copy=False)
    return name, a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (which would make 0-d 1-d)


def _prepare_module(key: object, target: object, blob: object) -> tuple[str, dict[str, Any], memoryview]:
    if not isinstance(key, str) or not key:
        raise BundleError(f"module key must be a non-empty string, got {key!r}")
    if not isinstance(target, dict):
        raise BundleError(f"module '{key}' target must be a dict, got {type(target).__name__}")
    try:
        view = memoryview(blob).cast("B")  # type: ignore[arg-type]
    except TypeError as e:
        raise BundleError(f"module '{key}' blob must be bytes-like: {e}") from None
    return key, target, view


def _unique(names: list[str], what: str) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise BundleError(f"duplicate {what} '{n}'")
        seen.add(n)


def _layout(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Offsets relative to the data section, each aligned; and the section's length."""
    offsets, pos = [], 0
    for n in sizes:
        off = _align_up(pos, align)
        offsets.append(off)
        pos = off + n
    return offsets, pos


class _HashingWriter:
    """Writes sequentially while hashing, so the file's sha256 costs no second read."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.pos, self.h = f, 0, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.h.update(data)
        self.pos += len(data)

    def pad_to(self, pos: int) -> None:
        if pos > self.pos:
            self.write(bytes(pos - self.pos))


def write_bundle(
    path: str | os.PathLike[str],
    manifest: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    modules: Iterable[tuple[str, dict[str, Any], bytes]] = (),
    *,
    align: int = DEFAULT_ALIGN,
) -> BundleInfo:
    """Write a bundle atomically; the same inputs always give the same bytes.

    Tensors are stored in the order given, then modules in the order given. Two passes over
    the inputs: the first hashes every blob (the hashes go in the manifest, which precedes the
    blobs), the second streams header, manifest and blobs to a temp file beside `path`, which
    is fsynced and renamed into place. The arrays must not change between the passes.
    """
    path = Path(path)
    if not MIN_ALIGN <= align <= MAX_ALIGN or align & (align - 1):
        raise BundleError(f"alignment must be a power of two in [{MIN_ALIGN}, {MAX_ALIGN}], got {align}")
    if not isinstance(manifest, dict):
        raise BundleError(f"manifest must be a dict, got {type(manifest).__name__}")
    if clash := [k for k in RESERVED_KEYS if k in manifest]:
        raise BundleError(f"manifest key '{clash[0]}' is reserved for the writer")

    tlist = [_prepare_tensor(n, a) for n, a in tensors]
    mlist = [_prepare_module(k, t, b) for k, t, b in modules]
    _unique([n for n, _ in tlist], "tensor")
    _unique([k for k, _, _ in mlist], "module")
    blobs = [_raw_bytes(a) for _, a in tlist] + [b for _, _, b in mlist]
    offsets, data_len = _layout([len(b) for b in blobs], align)
    hashes = _hash_all(blobs)  # pass 1

    table = [
        {
            "name": n,
            "dtype": a.dtype.str,
            "shape": list(a.shape),
            "offset": o,
            "nbytes": a.nbytes,
            "sha256": h,
        }
        for (n, a), o, h in zip(tlist, offsets, hashes, strict=False)  # modules come after
    ]
    mods = [
        {"key": k, "target": t, "offset": o, "nbytes": len(b), "sha256": h}
        for (k, t, b), o, h in zip(mlist, offsets[len(tlist) :], hashes[len(tlist) :], strict=True)
    ]
    try:
        body = _dumps({**manifest, "tensors": table, "modules": mods})
    except (TypeError, ValueError) as e:
        raise BundleError(f"manifest is not JSON-serializable: {e}") from None
    data_start = _align_up(HEADER_SIZE + len(body), align)
    size = data_start + data_len
    fixed = _FIELDS.pack(MAGIC, FORMAT_VERSION, align, len(body), size)
    header = fixed + hashlib.sha256(fixed + body).digest()

    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise BundleError(f"cannot write bundle {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f)
            w.write(header)
            w.write(body)
            for blob, off in zip(blobs, offsets, strict=True):  # pass 2
                w.pad_to(data_start + off)
                for i in range(0, len(blob), _CHUNK):
                    w.write(blob[i : i + _CHUNK])
            w.pad_to(size)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the bundle from other users
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise BundleError(f"cannot write bundle {path}: {e.strerror or e}") from None
        raise
    _fsync_dir(path.parent)
    return BundleInfo(size=size, sha256=w.h.hexdigest())


def _fsync_dir(d: Path) -> None:
    # Makes the rename durable; not every platform or filesystem allows opening a directory.
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------- reader


def _read_header(head: bytes, size: int) -> tuple[int, int, int, bytes]:
    """Check magic, version and the header's own bounds; return (align, manifest_len, size, hash)."""
    if head[: len(MAGIC)] != MAGIC[: len(head)]:  # a short prefix of the magic is a truncation
        raise BundleError("bad magic: not a .giw bundle")
    if len(head) >= 12:
        (version,) = struct.unpack_from("<I", head, 8)
        if version < FORMAT_VERSION:
            raise BundleError(
                f"bundle format v{version} is older than this goinfer reads (v{FORMAT_VERSION}): "
                "rebuild it with `goinfer build`"
            )
        if version != FORMAT_VERSION:
            raise BundleError(f"unsupported format version {version} (this reader reads {FORMAT_VERSION})")
    if len(head) < HEADER_SIZE:
        raise BundleError(f"bundle truncated: header needs {HEADER_SIZE} bytes but file has {size}")
    _, _, align, mlen, fsize, digest = _HEADER.unpack(head)
    if HEADER_SIZE + mlen > size:
        raise BundleError(f"bundle truncated: manifest ends at byte {HEADER_SIZE + mlen} but file has {size}")
    return align, mlen, fsize, digest


def _field(entry: dict[str, Any], key: str, kind: type, where: str) -> Any:
    v = entry.get(key)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BundleError(f"corrupt manifest: {where} field '{key}' is missing or not {kind.__name__}")
    if kind is int and v < 0:
        raise BundleError(f"corrupt manifest: {where} field '{key}' is negative")
    return v


def _sha_field(entry: dict[str, Any], where: str) -> str:
    h = _field(entry, "sha256", str, where)
    if len(h) != 64 or h.strip("0123456789abcdef"):
        raise BundleError(f"corrupt manifest: {where} sha256 is not 64 lowercase hex digits")
    return h


def _parse_tables(
    manifest: dict[str, Any], data_start: int
) -> tuple[dict[str, TensorEntry], dict[str, ModuleEntry]]:
    tables = manifest.get("tensors"), manifest.get("modules")
    if not all(isinstance(t, list) and all(isinstance(e, dict) for e in t) for t in tables):
        raise BundleError("corrupt manifest: 'tensors' and 'modules' must be lists of objects")
    tensors: dict[str, TensorEntry] = {}
    for i, e in enumerate(tables[0]):
        name = _field(e, "name", str, f"tensor #{i}")
        where = f"tensor '{name}'"
        dtype = _field(e, "dtype", str, where)
        if dtype not in DTYPES:
            raise BundleError(f"corrupt manifest: {where} has unsupported dtype {dtype!r}")
        shape = _field(e, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BundleError(f"corrupt manifest: {where} shape {shape} is not a list of non-negative ints")
        dt = np.dtype(dtype)
        # numpy refuses such shapes even when a zero dim makes them empty
        if len(shape) > _MAX_NDIM or math.prod(max(d, 1) for d in shape) * dt.itemsize >= 1 << 62:
            raise BundleError(f"corrupt manifest: {where} shape {shape} is too large")
        nbytes = _field(e, "nbytes", int, where)
        if nbytes != math.prod(shape) * dt.itemsize:
            raise BundleError(
                f"corrupt manifest: {where} nbytes {nbytes} does not match shape {shape} {dtype}"
            )
        if name in tensors:
            raise BundleError(f"corrupt manifest: duplicate tensor '{name}'")
        off = data_start + _field(e, "offset", int, where)
        tensors[name] = TensorEntry(name, dt, tuple(shape), off, nbytes, _sha_field(e, where))
    modules: dict[str, ModuleEntry] = {}
    for i, e in enumerate(tables[1]):
        key = _field(e, "key", str, f"module #{i}")
        where = f"module '{key}'"
        target = _field(e, "target", dict, where)
        if key in modules:
            raise BundleError(f"corrupt manifest: duplicate module '{key}'")
        off = data_start + _field(e, "offset", int, where)
        modules[key] = ModuleEntry(key, target, off, _field(e, "nbytes", int, where), _sha_field(e, where))
    return tensors, modules


def _blob_label(e: TensorEntry | ModuleEntry) -> str:
    return f"tensor '{e.name}'" if isinstance(e, TensorEntry) else f"module '{e.key}'"


def _check_layout(
    blobs: list[TensorEntry | ModuleEntry], align: int, data_start: int, fsize: int, size: int
) -> None:
    """Every blob aligned, inside the file, and clear of the others; the file exactly as long as said."""
    end = data_start
    for e in sorted(blobs, key=lambda b: b.file_offset):
        label = _blob_label(e)
        if e.file_offset % align:
            raise BundleError(f"corrupt manifest: {label} offset {e.file_offset} is not {align}-aligned")
        if e.file_offset < end:
            raise BundleError(f"corrupt manifest: {label} at byte {e.file_offset} overlaps the previous blob")
        end = e.file_offset + e.nbytes
        if end > size:
            raise BundleError(f"bundle truncated: {label} ends at byte {end} but file has {size}")
    if fsize != end:
        raise BundleError(f"corrupt header: file size {fsize} but the data ends at byte {end}")
    if size < fsize:
        raise BundleError(f"bundle truncated: header says {fsize} bytes but file has {size}")
    if size > fsize:
        raise BundleError(f"trailing data: file has {size} bytes but header says {fsize}")


class Bundle:
    """An open bundle: the file mapped once; tensors are views into the mapping.

    Do not modify a bundle in place while it is open (write_bundle replaces files atomically,
    so rebuilding is safe): a mapped file that shrinks under a reader faults on access.
    """

    def __init__(
        self,
        path: Path,
        mm: mmap.mmap,
        manifest: dict[str, Any],
        tensors: dict[str, TensorEntry],
        modules: dict[str, ModuleEntry],
        padding: list[tuple[int, int]],
        header_sha256: str,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.header_sha256 = header_sha256
        self.size = len(mm)
        self._mm: mmap.mmap | None = mm
        self._tensors = tensors
        self._modules = modules
        self._padding = padding
        self.verified = False

    # -- lifecycle

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            # Views handed out keep the mapping alive; it is unmapped when the last one dies.
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise BundleError(f"bundle {self.path} is closed")
        return self._mm

    @property
    def mapping(self) -> memoryview:
        """The whole file, zero-copy."""
        return memoryview(self._map())

    # -- tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorEntry:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no tensor '{name}' in bundle {self.path}") from None

    def tensor(self, name: str) -> np.ndarray:
        """A view of the tensor inside the mapping (read-only unless opened private); no copy."""
        e = self.tensor_info(name)
        flat = np.frombuffer(self._map(), e.dtype, e.nbytes // e.dtype.itemsize, e.file_offset)
        return flat.reshape(e.shape)

    # -- modules

    def module_keys(self) -> list[str]:
        return list(self._modules)

    def module_info(self, key: str) -> ModuleEntry:
        try:
            return self._modules[key]
        except KeyError:
            raise KeyError(f"no module '{key}' in bundle {self.path}") from None

    def module_bytes(self, key: str, *, verify: bool = False) -> memoryview:
        e = self.module_info(key)
        view = self.mapping[e.file_offset : e.file_offset + e.nbytes]
        if verify and not self.verified and _sha256_hex(view) != e.sha256:
            raise BundleError(f"sha256 mismatch in module '{key}'")
        return view

    def extract_module(self, key: str, dest_dir: str | os.PathLike[str], *, verify: bool = True) -> Path:
        """Write the module blob once to `<dest_dir>/<sha256>.so` (TVM loads libraries from a path).

        An existing file of the right size is reused: it can only have got there by rename.
        """
        e = self.module_info(key)
        dest = Path(dest_dir)
        out = dest / f"{e.sha256}.so"
        with contextlib.suppress(OSError):
            if out.stat().st_size == e.nbytes:
                return out
        blob = self.module_bytes(key, verify=verify)
        tmp = None
        try:
            dest.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{e.sha256}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except OSError as err:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise BundleError(f"cannot extract module '{key}' to {dest}: {err.strerror or err}") from None
        return out

    # -- verification

    def verify(self) -> None:
        """Hash every blob and check that all padding is zero: then every byte has been checked."""
        mm = self._map()
        for a, b in self._padding:
            if np.count_nonzero(np.frombuffer(mm, np.uint8, b - a, a)):
                raise BundleError(f"corrupt padding: nonzero bytes between byte {a} and {b}")
        blobs = [*self._tensors.values(), *self._modules.values()]
        views = [self.mapping[e.file_offset : e.file_offset + e.nbytes] for e in blobs]
        for e, h in zip(blobs, _hash_all(views), strict=True):
            if h != e.sha256:
                raise BundleError(f"sha256 mismatch in {_blob_label(e)}")
        self.verified = True


def _padding(blobs: list[TensorEntry | ModuleEntry], manifest_end: int, size: int) -> list[tuple[int, int]]:
    gaps, pos = [], manifest_end
    for e in sorted(blobs, key=lambda b: b.file_offset):
        if e.file_offset > pos:
            gaps.append((pos, e.file_offset))
        pos = max(pos, e.file_offset + e.nbytes)
    if size > pos:
        gaps.append((pos, size))
    return gaps


def _marker(cache_root: str | os.PathLike[str] | None, header_sha256: str, st: os.stat_result) -> Path:
    # Any rewrite changes the inode (atomic rename) or mtime; a rebuild changes the header hash.
    name = f"{header_sha256}-{st.st_size}-{st.st_mtime_ns}-{st.st_dev}-{st.st_ino}"
    return cache.folder("verified", cache_root) / name


def open_bundle(
    path: str | os.PathLike[str],
    verify: Verify = "once",
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    private: bool = False,
) -> Bundle:
    """Open and check a bundle; refuse it with a BundleError naming what is wrong.

    The cheap checks (magic, version, header checksum, layout) always run. verify="full" also
    hashes every blob; "once" does so only the first time this exact file is seen (same header,
    size, mtime and inode), recording a marker in the `verified/` folder of the cache root
    `cache_dir` (default: cache.root()); "none" skips it.

    The map is read-only, or with private=True copy-on-write: tensors are then writable views
    (DLPack refuses read-only arrays) whose writes never reach the file.
    """
    if verify not in ("full", "once", "none"):
        raise ValueError(f"verify must be 'full', 'once' or 'none', got {verify!r}")
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - the mapping outlives the file object
    except OSError as e:
        raise BundleError(f"cannot open bundle {path}: {e.strerror or e}") from None
    with f:
        st = os.fstat(f.fileno())
        head = f.read(HEADER_SIZE)
        align, mlen, fsize, digest = _read_header(head, st.st_size)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
    try:
        bundle = _load(path, mm, align, mlen, fsize, digest)
    except BaseException:
        mm.close()
        raise
    if verify == "none":
        return bundle
    marker = _marker(cache_dir, bundle.header_sha256, st)
    if verify == "once" and marker.exists():
        return bundle
    try:
        bundle.verify()
    except BaseException:
        bundle.close()
        raise
    if verify == "once":
        with contextlib.suppress(OSError):  # an unwritable cache only costs a re-hash next time
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return bundle


def _load(path: Path, mm: mmap.mmap, align: int, mlen: int, fsize: int, digest: bytes) -> Bundle:
    size = len(mm)
    body = mm[HEADER_SIZE : HEADER_SIZE + mlen]
    if len(body) != mlen:  # the file shrank between stat and map
        raise BundleError(f"bundle truncated: manifest ends at byte {HEADER_SIZE + mlen} but file has {size}")
    check = hashlib.sha256(mm[:_HASHED_HEADER])
    check.update(body)
    if check.digest() != digest:
        raise BundleError("manifest checksum mismatch: header or manifest bytes are corrupt")
    if not MIN_ALIGN <= align <= MAX_ALIGN or align & (align - 1):
        raise BundleError(
            f"corrupt header: alignment {align} is not a power of two in [{MIN_ALIGN}, {MAX_ALIGN}]"
        )
    try:
        manifest = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise BundleError(f"corrupt manifest: not UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(manifest, dict):
        raise BundleError("corrupt manifest: top level is not an object")
    data_start = _align_up(HEADER_SIZE + mlen, align)
    tensors, modules = _parse_tables(manifest, data_start)
    blobs: list[TensorEntry | ModuleEntry] = [*tensors.values(), *modules.values()]
    _check_layout(blobs, align, data_start, fsize, size)
    padding = _padding(blobs, HEADER_SIZE + mlen, size)
    return Bundle(path, mm, manifest, tensors, modules, padding, digest.hex())
