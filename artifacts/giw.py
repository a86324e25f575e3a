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
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from . import cache

MAGIC = b"\x89GIW\r\n\x1a\n"  # PNG-style: the high byte and CR/LF catch text-mode mangling
# 2: the typed manifest (manifest.py); 3: one-pass prefill attention, which the runtime routes the
# cache's prefill calls to (runtime/tvm_runtime.py). Older bundles are refused, to be rebuilt.
FORMAT_VERSION = 3
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


def _layout(sizes: list[int], align: int, start: int = 0) -> tuple[list[int], int]:
    """Offsets relative to the data section, each aligned, the first at or after `start`; and the
    section's length."""
    offsets, pos = [], start
    for n in sizes:
        off = _align_up(pos, align)
        offsets.append(off)
        pos = off + n
    return offsets, pos


_NO_HASH = "0" * 64  # a placeholder of a hash's length: the manifest's length does not depend on it


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _copy_range(src: int, dst: int, count: int, src_off: int, dst_off: int) -> None:
    """count bytes from src_off in one file to dst_off in another: in the kernel where it can."""
    with contextlib.suppress(AttributeError, OSError):  # no copy_file_range here, or not for these
        while count:
            n = os.copy_file_range(src, dst, count, src_off, dst_off)
            if n == 0:
                break
            count, src_off, dst_off = count - n, src_off + n, dst_off + n
    while count:  # what is left: through a buffer
        chunk = os.pread(src, min(count, _CHUNK), src_off)
        if not chunk:
            raise OSError(f"the data ends {count} bytes short")
        _pwrite_all(dst, memoryview(chunk), dst_off)
        count, src_off, dst_off = count - len(chunk), src_off + len(chunk), dst_off + len(chunk)


@dataclass
class _Slot:
    """A declared tensor of a BundleWriter: where it goes, and what of it has come so far."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # relative to the data section
    nbytes: int
    hasher: Any
    lock: threading.Lock
    written: int = 0


class BundleWriter:
    """A bundle written as its tensors arrive: in pieces, in any tensor order, from any thread.

    Declare every tensor first (`add_tensor`: name, dtype and shape fix its place), then `write`
    each one's bytes in order, a piece at a time: each piece is hashed and written to its place
    at once, so no tensor need be held whole, and different tensors may be written concurrently.
    `finish` adds the modules, writes the manifest (now that every hash is known) and the header
    in front, and renames the file into place. The bytes are exactly `write_bundle`'s for the same
    content.

    The data section starts after the manifest, whose length is known only at the end; `plan`
    fixes it from a manifest and modules of the final lengths (the hashes do not count). Without
    a plan, or where the final manifest's length lands on another page, `finish` moves the data
    once. Everything goes to a temp file beside `path`: a writer that fails, or is left without
    `finish` (`abort`, or an exception out of its `with` block), leaves nothing behind.
    """

    def __init__(self, path: str | os.PathLike[str], *, align: int = DEFAULT_ALIGN) -> None:
        if not MIN_ALIGN <= align <= MAX_ALIGN or align & (align - 1):
            raise BundleError(f"alignment must be a power of two in [{MIN_ALIGN}, {MAX_ALIGN}], got {align}")
        self.path, self.align = Path(path), align
        self._slots: dict[str, _Slot] = {}
        self._end = 0  # of the tensors, relative to the data section
        self._base: int | None = None  # the data section's file offset, fixed at the first write
        self._declare_lock = threading.Lock()
        try:
            self._fd, self._tmp = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
            )
        except OSError as e:
            raise BundleError(f"cannot write bundle {self.path}: {e.strerror or e}") from None
        self._open = True

    # -- declaring and writing

    def add_tensor(self, name: str, dtype: Any, shape: Iterable[int]) -> None:
        """Append a tensor to the table: its bytes come later, through `write`."""
        if not isinstance(name, str) or not name:
            raise BundleError(f"tensor name must be a non-empty string, got {name!r}")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise BundleError(f"tensor '{name}' has unsupported dtype {dtype}") from None
        if dt.newbyteorder("<").str not in DTYPES:
            raise BundleError(f"tensor '{name}' has unsupported dtype {dt}")
        shape = tuple(int(d) for d in shape)
        if len(shape) > _MAX_NDIM:
            raise BundleError(
                f"tensor '{name}' has {len(shape)} dimensions; at most {_MAX_NDIM} are supported"
            )
        if any(d < 0 for d in shape):
            raise BundleError(f"tensor '{name}' has a negative dimension: {list(shape)}")
        with self._declare_lock:
            self._check_open()
            if name in self._slots:
                raise BundleError(f"duplicate tensor '{name}'")
            nbytes = math.prod(shape) * dt.itemsize
            offset = _align_up(self._end, self.align)
            self._slots[name] = _Slot(
                name, dt.newbyteorder("<"), shape, offset, nbytes, hashlib.sha256(), threading.Lock()
            )
            self._end = offset + nbytes

    def plan(self, manifest: dict[str, Any], modules: Iterable[tuple[str, dict[str, Any], Any]] = ()) -> None:
        """Place the data section for this manifest and these modules (each given as its blob or
        just its length): what `finish` gets should have the same lengths. Before any `write`."""
        with self._declare_lock:
            self._check_open()
            if self._base is not None:
                raise BundleError("plan the bundle before writing to it")
            mods = [
                (k, t, b if isinstance(b, int) else len(_prepare_module(k, t, b)[2])) for k, t, b in modules
            ]
            self._place(self._data_start(self._body(manifest, mods, None)))

    def write(self, name: str, data: Any) -> None:
        """The next piece of tensor `name`'s bytes (an array of its dtype, or bytes), in order."""
        slot = self._slot(name)
        if isinstance(data, np.ndarray):
            if data.dtype.newbyteorder("<") != slot.dtype:
                raise BundleError(f"tensor '{name}' is {slot.dtype}, got a piece of {data.dtype}")
            view = _raw_bytes(np.ascontiguousarray(data.astype(slot.dtype, copy=False)))
        else:
            view = memoryview(data).cast("B")
        if self._base is None:
            with self._declare_lock:
                if self._base is None:  # unplanned: a guess, moved by finish if wrong
                    self._place(self._data_start(self._body({}, [], None)))
        with slot.lock:
            if slot.written + len(view) > slot.nbytes:
                raise BundleError(f"tensor '{name}' is {slot.nbytes} bytes; got {slot.written + len(view)}")
            at = self._base + slot.offset + slot.written
            slot.written += len(view)
            for i in range(0, len(view), _CHUNK):
                piece = view[i : i + _CHUNK]
                slot.hasher.update(piece)
                try:
                    _pwrite_all(self._fd, piece, at + i)
                except OSError as e:
                    raise BundleError(f"cannot write bundle {self.path}: {e.strerror or e}") from None

    def put(self, name: str, arr: Any) -> None:
        """Declare and write a whole tensor."""
        name, a = _prepare_tensor(name, arr)
        self.add_tensor(name, a.dtype, a.shape)
        self.write(name, a)

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of a tensor written whole (mapped from the file, not a copy)."""
        slot = self._slot(name)
        if slot.written != slot.nbytes:
            raise BundleError(f"tensor '{name}' is not written yet")
        if slot.nbytes == 0:
            return np.zeros(slot.shape, slot.dtype)
        assert self._base is not None
        return np.memmap(self._tmp, slot.dtype, "r", self._base + slot.offset, slot.shape)

    # -- finishing

    def finish(
        self, manifest: dict[str, Any], modules: Iterable[tuple[str, dict[str, Any], bytes]] = ()
    ) -> BundleInfo:
        """Write the modules, the manifest and the header, and rename the bundle into place."""
        try:
            return self._finish(manifest, modules)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise BundleError(f"cannot write bundle {self.path}: {e.strerror or e}") from None
            raise

    def _finish(
        self, manifest: dict[str, Any], modules: Iterable[tuple[str, dict[str, Any], bytes]]
    ) -> BundleInfo:
        self._check_open()
        mlist = [_prepare_module(k, t, b) for k, t, b in modules]
        _unique([k for k, _, _ in mlist], "module")
        if short := [s for s in self._slots.values() if s.written != s.nbytes]:
            s = short[0]
            raise BundleError(f"tensor '{s.name}' got {s.written} of its {s.nbytes} bytes")
        body = self._body(
            manifest, [(k, t, len(b)) for k, t, b in mlist], _hash_all([b for _, _, b in mlist])
        )
        data_start = self._data_start(body)
        if self._base is not None and self._base != data_start and self._end:
            self._move_data(data_start)
        self._base = data_start
        mod_offsets, end = _layout([len(b) for _, _, b in mlist], self.align, self._end)
        for (_k, _t, blob), off in zip(mlist, mod_offsets, strict=True):
            _pwrite_all(self._fd, blob, data_start + off)
        size = data_start + end
        fixed = _FIELDS.pack(MAGIC, FORMAT_VERSION, self.align, len(body), size)
        _pwrite_all(self._fd, memoryview(fixed + hashlib.sha256(fixed + body).digest() + body), 0)
        os.ftruncate(self._fd, size)  # the last blob ends the file; gaps read as zeros
        # The file's hash needs a second read (its first bytes were written last), from the page
        # cache: done while the data goes to disk.
        with ThreadPoolExecutor(max_workers=1) as pool:
            synced = pool.submit(os.fsync, self._fd)
            digest = _hash_fd(self._fd, size)
            synced.result()
        os.close(self._fd)
        self._open = False
        os.chmod(self._tmp, 0o644)  # mkstemp's 0600 would hide the bundle from other users
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
        return BundleInfo(size=size, sha256=digest)

    def abort(self) -> None:
        """Drop the bundle: the temp file goes, nothing is renamed."""
        if self._open:
            self._open = False
            with contextlib.suppress(OSError):
                os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None or self._open:
            self.abort()

    # -- internals

    def _check_open(self) -> None:
        if not self._open:
            raise BundleError(f"bundle writer for {self.path} is closed")

    def _slot(self, name: str) -> _Slot:
        self._check_open()
        try:
            return self._slots[name]
        except KeyError:
            raise BundleError(f"tensor '{name}' was not declared") from None

    def _body(
        self,
        manifest: dict[str, Any],
        modules: list[tuple[str, dict[str, Any], int]],
        hashes: list[str] | None,
    ) -> bytes:
        """The manifest's bytes; with placeholder hashes where `hashes` (the modules') is None."""
        if not isinstance(manifest, dict):
            raise BundleError(f"manifest must be a dict, got {type(manifest).__name__}")
        if clash := [k for k in RESERVED_KEYS if k in manifest]:
            raise BundleError(f"manifest key '{clash[0]}' is reserved for the writer")
        final = hashes is not None
        table = [
            {
                "name": s.name,
                "dtype": s.dtype.str,
                "shape": list(s.shape),
                "offset": s.offset,
                "nbytes": s.nbytes,
                "sha256": s.hasher.hexdigest() if final else _NO_HASH,
            }
            for s in self._slots.values()
        ]
        offsets, _ = _layout([n for _, _, n in modules], self.align, self._end)
        mods = [
            {"key": k, "target": t, "offset": o, "nbytes": n, "sha256": hashes[i] if final else _NO_HASH}
            for i, ((k, t, n), o) in enumerate(zip(modules, offsets, strict=True))
        ]
        try:
            return _dumps({**manifest, "tensors": table, "modules": mods})
        except (TypeError, ValueError) as e:
            raise BundleError(f"manifest is not JSON-serializable: {e}") from None

    def _data_start(self, body: bytes) -> int:
        return _align_up(HEADER_SIZE + len(body), self.align)

    def _place(self, base: int) -> None:
        """Fix the data section's start, and allocate the file up to the tensors' end: writes
        into allocated blocks are cheap (ext4: 477 MB in pieces 0.1 s, against 0.2-1.2 s when
        each write extends the file)."""
        self._base = base
        _preallocate(self._fd, base + self._end)

    def _move_data(self, data_start: int) -> None:
        """The manifest came out longer or shorter than planned: the tensors move, into a new temp
        file at their final place."""
        assert self._base is not None
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            _preallocate(fd, data_start + self._end)
            _copy_range(self._fd, fd, self._end, self._base, data_start)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(self._fd)
        os.unlink(self._tmp)
        self._fd, self._tmp = fd, tmp


def _preallocate(fd: int, size: int) -> None:
    if size > 0:
        with contextlib.suppress(AttributeError, OSError):  # not every platform or filesystem has it
            os.posix_fallocate(fd, 0, size)


def _hash_fd(fd: int, size: int) -> str:
    """sha256 of the file's first `size` bytes, read into one buffer (not mapped: a mapping's pages
    would count against the writer's resident memory, the whole bundle of them)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(min(size, _CHUNK)))
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        f.seek(0)
        done = 0
        while done < size and (n := f.readinto(buf[: min(len(buf), size - done)])):
            h.update(buf[:n])
            done += n
    if done != size:
        raise OSError(f"read {done} of {size} bytes back")
    return h.hexdigest()


def write_bundle(
    path: str | os.PathLike[str],
    manifest: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    modules: Iterable[tuple[str, dict[str, Any], bytes]] = (),
    *,
    align: int = DEFAULT_ALIGN,
) -> BundleInfo:
    """Write a bundle atomically; the same inputs always give the same bytes.

    Tensors are stored in the order given, then modules in the order given: a BundleWriter fed
    whole arrays (on threads for big bundles: hashing and writing release the GIL), which writes
    to a temp file beside `path`, fsyncs it and renames it into place.
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
    with BundleWriter(path, align=align) as w:
        for n, a in tlist:
            w.add_tensor(n, a.dtype, a.shape)
        w.plan(manifest, mlist)
        if len(tlist) > 1 and sum(a.nbytes for _, a in tlist) >= _PARALLEL_BYTES:
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda item: w.write(*item), tlist))
        else:
            for n, a in tlist:
                w.write(n, a)
        return w.finish(manifest, mlist)


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
