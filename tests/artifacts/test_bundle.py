"""The .giw bundle: exact bytes, reproducibility, refusal of damaged files, zero-copy reads."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from goinfer.artifacts import giw
from goinfer.artifacts.giw import BundleError, open_bundle, write_bundle

GOLDEN_HEX = Path(__file__).resolve().parents[1] / "goldens" / "tiny_bundle.hex"
# Changes only with the format (or the inputs below); regenerate with GOINFER_UPDATE_GOLDENS=1.
GOLDEN_SHA256 = "60b3b318a489919ce40faf571b8729ece97637e1fc215f0b7bf2d727a03811eb"


def tiny_inputs() -> tuple[dict[str, Any], list[tuple[str, np.ndarray]], list[tuple[str, dict, bytes]]]:
    manifest = {
        "goinfer_version": "0.0.0-test",
        "tvm_version": "0.0",
        "family": "llama",
        "quant": "f32",
        "context_length": 64,
        "tokenizer": '{"model":{"type":"BPE"}}',
        "chat_template": "{{ messages }}",
        "tokens": {"bos_id": 1, "stop_ids": [2]},
        "source": {"ref": "tiny.gguf", "sha256": "ab" * 32},
        "note": "héllo ✓",  # pins the UTF-8 (not \\u-escaped) encoding
    }
    tensors = [
        ("tok_embd.weight", np.arange(12, dtype=np.float32).reshape(4, 3) / 4),
        ("blk.0.attn_q.weight", np.arange(-4, 4, dtype=np.int8).reshape(2, 4)),
        ("blk.0.scales", np.array([1.5, -2.0], dtype=np.float16)),
    ]
    modules = [("cpu", {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}, b"\x7fELF fake module\x00\x01\x02")]
    return manifest, tensors, modules


def hexdump(data: bytes) -> str:
    """`hexdump -C` style, repeated lines folded to '*', so a format change reads in review."""
    lines, prev, folded = [], None, False
    for off in range(0, len(data), 16):
        row = data[off : off + 16]
        if row == prev:
            if not folded:
                lines.append("*")
            folded = True
            continue
        prev, folded = row, False
        hexes = " ".join(f"{b:02x}" for b in row)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        lines.append(f"{off:08x}  {hexes:<47}  |{text}|")
    lines.append(f"{len(data):08x}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.giw"
    write_bundle(path, *tiny_inputs())
    return path


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))  # never touch the user's cache


def damaged(path: Path, edit: Any) -> Path:
    data = bytearray(path.read_bytes())
    data = edit(data) or data
    out = path.with_name("damaged.giw")
    out.write_bytes(bytes(data))
    return out


def refused(path: Path, verify: giw.Verify = "full") -> str:
    with pytest.raises(BundleError) as exc:
        open_bundle(path, verify=verify)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def flip(pos: int, bit: int = 0) -> Any:
    def edit(d: bytearray) -> None:
        d[pos] ^= 1 << bit

    return edit


def blob_start(path: Path, name: str) -> int:
    with open_bundle(path, verify="none") as b:
        return (b.tensor_info(name) if name in b.tensor_names() else b.module_info(name)).file_offset


# ------------------------------------------------------------------------------------------ bytes


def test_golden_bytes(tiny: Path) -> None:
    data = tiny.read_bytes()
    if os.environ.get("GOINFER_UPDATE_GOLDENS"):
        GOLDEN_HEX.write_text(hexdump(data))
        pytest.skip(f"golden rewritten; sha256 is {hashlib.sha256(data).hexdigest()}")
    assert hexdump(data) == GOLDEN_HEX.read_text()
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    infos = []
    for sub in ("a", "b/c"):
        (tmp_path / sub).mkdir(parents=True)
        infos.append(write_bundle(tmp_path / sub / "x.giw", *tiny_inputs()))
    a, b = (tmp_path / "a" / "x.giw").read_bytes(), (tmp_path / "b/c" / "x.giw").read_bytes()
    assert a == b
    assert infos[0] == infos[1] == giw.BundleInfo(size=len(a), sha256=hashlib.sha256(a).hexdigest())


def test_chunked_and_threaded_paths_give_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Big bundles stream in chunks and hash on threads; shrink both thresholds to reach them here.
    monkeypatch.setattr(giw, "_CHUNK", 5)
    monkeypatch.setattr(giw, "_PARALLEL_BYTES", 0)
    path = tmp_path / "x.giw"
    write_bundle(path, *tiny_inputs())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_SHA256
    open_bundle(path, verify="full").close()


def test_header_layout(tiny: Path) -> None:
    data = tiny.read_bytes()
    magic, version, align, mlen, fsize, digest = struct.unpack_from("<8sIIQQ32s", data)
    assert (magic, version, align, fsize) == (b"\x89GIW\r\n\x1a\n", 3, 4096, len(data))
    body = data[64 : 64 + mlen]
    assert hashlib.sha256(data[:32] + body).digest() == digest
    manifest = json.loads(body)
    assert body == json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    data_start = -(-(64 + mlen) // align) * align
    for entry in manifest["tensors"] + manifest["modules"]:
        start = data_start + entry["offset"]
        assert start % align == 0
        assert hashlib.sha256(data[start : start + entry["nbytes"]]).hexdigest() == entry["sha256"]


def test_roundtrip_dtypes_and_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        dt: (rng.standard_normal((3, 5)) * 50).astype(dt)
        for dt in (
            "float32",
            "float16",
            "float64",
            "int8",
            "uint8",
            "int16",
            "uint16",
            "int32",
            "uint32",
            "int64",
        )
    }
    arrays["big_endian"] = np.arange(6, dtype=">i4")
    arrays["strided"] = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    arrays["scalar"] = np.float32(3.25)
    arrays["empty"] = np.zeros((0, 7), np.uint8)
    arrays["bool"] = np.array([True, False, True])
    names = list(reversed(arrays))  # not sorted: the given order is kept
    path = tmp_path / "all.giw"
    mod = bytes(range(256)) * 3
    write_bundle(path, {"family": "x"}, [(n, arrays[n]) for n in names], [("cpu", {"kind": "llvm"}, mod)])
    with open_bundle(path, verify="full") as b:
        assert b.tensor_names() == names
        assert b.module_keys() == ["cpu"]
        assert bytes(b.module_bytes("cpu", verify=True)) == mod
        assert {k: v for k, v in b.manifest.items() if k not in ("tensors", "modules")} == {"family": "x"}
        for n in names:
            got, want = b.tensor(n), np.asarray(arrays[n])
            assert got.shape == want.shape and got.dtype == want.dtype.newbyteorder("<")
            assert np.array_equal(got, want)
            assert got.dtype.byteorder in "<|="


def test_zero_copy_views(tiny: Path) -> None:
    with open_bundle(tiny, verify="none") as b:
        whole = np.frombuffer(b.mapping, np.uint8)
        lo, hi = whole.ctypes.data, whole.ctypes.data + whole.nbytes
        for name in b.tensor_names():
            t, info = b.tensor(name), b.tensor_info(name)
            assert not t.flags.owndata and not t.flags.writeable
            assert np.shares_memory(t, whole)
            assert t.ctypes.data == lo + info.file_offset  # exactly where the blob lies in the mapping
            assert lo <= t.ctypes.data and t.ctypes.data + t.nbytes <= hi
            assert t.ctypes.data % 4096 == 0  # page-aligned, so DLPack can wrap it as is
            base = t
            while getattr(base, "base", None) is not None:
                base = base.base
            if isinstance(base, memoryview):  # numpy keeps the buffer export, whose .obj is the map
                base = base.obj
            assert isinstance(base, giw.mmap.mmap)
        assert np.shares_memory(b.tensor("tok_embd.weight"), b.tensor("tok_embd.weight"))
        del whole


def test_private_map_is_writable_but_never_writes_back(tiny: Path) -> None:
    before = tiny.read_bytes()
    with open_bundle(tiny, verify="full", private=True) as b:
        t = b.tensor("tok_embd.weight")
        assert t.flags.writeable and np.shares_memory(t, np.frombuffer(b.mapping, np.uint8))
        t[:] = -1
        assert (b.tensor("tok_embd.weight") == -1).all()  # same memory
    assert tiny.read_bytes() == before
    with open_bundle(tiny, verify="full") as b:
        assert b.tensor("tok_embd.weight")[3, 2] == 11 / 4


def test_close_keeps_live_views_valid(tiny: Path) -> None:
    b = open_bundle(tiny, verify="none")
    t = b.tensor("tok_embd.weight")
    b.close()
    b.close()  # idempotent
    assert t[3, 2] == 11 / 4
    with pytest.raises(BundleError, match="closed"):
        b.tensor("tok_embd.weight")
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        open_bundle(tiny, verify="none").tensor("nope")


# ------------------------------------------------------------------------------------------ refusals


def test_bad_magic_and_non_bundles(tiny: Path, tmp_path: Path) -> None:
    assert refused(damaged(tiny, flip(0, 7))) == "bad magic: not a .giw bundle"
    text = tmp_path / "notes.giw"
    text.write_text("hello, this is not a bundle at all, but long enough to have a header\n")
    assert refused(text) == "bad magic: not a .giw bundle"
    empty = tmp_path / "empty.giw"
    empty.write_bytes(b"")
    assert "truncated" in refused(empty)
    assert "cannot open bundle" in refused(tmp_path / "missing.giw")


def test_future_version(tiny: Path) -> None:
    msg = refused(damaged(tiny, lambda d: d.__setitem__(slice(8, 12), struct.pack("<I", 9))))
    assert msg == "unsupported format version 9 (this reader reads 3)"


def test_older_version_is_refused_with_a_rebuild_hint(tiny: Path) -> None:
    msg = refused(damaged(tiny, lambda d: d.__setitem__(slice(8, 12), struct.pack("<I", 2))))
    assert msg == "bundle format v2 is older than this goinfer reads (v3): rebuild it with `goinfer build`"


@pytest.mark.parametrize(
    ("where", "expect"),
    [
        (lambda p: 5, "header needs 64 bytes but file has 5"),
        (lambda p: 40, "header needs 64 bytes but file has 40"),
        (lambda p: 64 + 30, "manifest ends at byte"),
        (lambda p: blob_start(p, "blk.0.attn_q.weight") + 3, "tensor 'blk.0.attn_q.weight' ends at byte"),
        (lambda p: blob_start(p, "blk.0.scales") - 100, "tensor 'blk.0.scales' ends at byte"),
        (lambda p: p.stat().st_size - 1, "module 'cpu' ends at byte"),
    ],
    ids=["in-magic", "in-header", "in-manifest", "in-tensor", "in-padding", "in-module"],
)
def test_truncated(tiny: Path, where: Any, expect: str) -> None:
    cut = where(tiny)
    msg = refused(damaged(tiny, lambda d: d[:cut]), verify="none")
    assert msg.startswith("bundle truncated: ") and expect in msg
    assert msg.endswith(f"file has {cut}")


def test_trailing_data(tiny: Path) -> None:
    msg = refused(damaged(tiny, lambda d: d + b"\0"), verify="none")
    assert msg.startswith("trailing data: ")


@pytest.mark.parametrize("pos", [12, 16, 24, 33, 63, 64, 64 + 100], ids=lambda p: f"byte{p}")
def test_header_and_manifest_bitflips_always_caught(tiny: Path, pos: int) -> None:
    # The header checksum covers the fixed fields and the manifest, even with verify="none".
    assert refused(damaged(tiny, flip(pos)), verify="none").startswith("manifest checksum mismatch")


@pytest.mark.parametrize("verify", ["full", "once"])
def test_tensor_bitflip_caught_by_verification(tiny: Path, verify: giw.Verify) -> None:
    bad = damaged(tiny, flip(blob_start(tiny, "blk.0.attn_q.weight") + 5, 3))
    assert refused(bad, verify) == "sha256 mismatch in tensor 'blk.0.attn_q.weight'"
    with open_bundle(bad, verify="none") as b:  # the cheap checks alone do not read blobs
        assert b.tensor("blk.0.attn_q.weight")[1, 1] != 1
        with pytest.raises(BundleError, match="sha256 mismatch in tensor"):
            b.verify()


def test_padding_bitflip_caught_by_verification(tiny: Path) -> None:
    assert refused(damaged(tiny, flip(blob_start(tiny, "cpu") - 1))).startswith("corrupt padding")


def test_module_checked_when_extracted(tiny: Path, tmp_path: Path) -> None:
    bad = damaged(tiny, flip(blob_start(tiny, "cpu") + 2))
    assert refused(bad) == "sha256 mismatch in module 'cpu'"
    with open_bundle(bad, verify="none") as b:
        with pytest.raises(BundleError, match="sha256 mismatch in module 'cpu'"):
            b.module_bytes("cpu", verify=True)
        with pytest.raises(BundleError, match="sha256 mismatch in module 'cpu'"):
            b.extract_module("cpu", tmp_path / "mods")
    assert not (tmp_path / "mods").exists() or not list((tmp_path / "mods").iterdir())


def rewrite_manifest(path: Path, edit: Any) -> Path:
    """A crafted file: edited manifest and a *valid* checksum, to reach the deeper checks."""

    def apply(d: bytearray) -> bytearray:
        mlen = struct.unpack_from("<Q", d, 16)[0]
        manifest = json.loads(d[64 : 64 + mlen])
        edit(manifest)
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        assert 64 + len(body) <= 4096  # the data section does not move
        fixed = bytearray(d[:32])
        fixed[16:24] = struct.pack("<Q", len(body))
        pad = bytes(4096 - 64 - len(body))
        return fixed + hashlib.sha256(bytes(fixed) + body).digest() + body + pad + d[4096:]

    return damaged(path, apply)


def _set(table: str, i: int, key: str, value: Any) -> Any:
    return lambda m: m[table][i].__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (_set("tensors", 1, "offset", 4097), "offset 8193 is not 4096-aligned"),
        (_set("tensors", 1, "offset", 0), "overlaps the previous blob"),
        (_set("tensors", 0, "dtype", "<c8"), "unsupported dtype '<c8'"),
        (_set("tensors", 0, "shape", [4, 4]), "nbytes 48 does not match shape [4, 4] <f4"),
        (_set("tensors", 0, "shape", [0, 2**62]), "is too large"),
        (_set("tensors", 2, "name", "tok_embd.weight"), "duplicate tensor 'tok_embd.weight'"),
        (_set("modules", 0, "nbytes", "big"), "module 'cpu' field 'nbytes' is missing or not int"),
        (_set("modules", 0, "sha256", "XY" * 32), "sha256 is not 64 lowercase hex digits"),
        (_set("modules", 0, "nbytes", 10**6), "module 'cpu' ends at byte"),
        (lambda m: m.pop("tensors"), "must be lists of objects"),
    ],
    ids=[
        "misaligned",
        "overlap",
        "dtype",
        "nbytes",
        "huge-shape",
        "dup",
        "type",
        "hex",
        "past-end",
        "no-table",
    ],
)
def test_crafted_manifest_refused(tiny: Path, edit: Any, expect: str) -> None:
    msg = refused(rewrite_manifest(tiny, edit), verify="none")
    assert expect in msg, msg


def test_crafted_file_size_refused(tiny: Path) -> None:
    def grow(d: bytearray) -> None:
        d[24:32] = struct.pack("<Q", len(d) + 4096)
        d[32:64] = hashlib.sha256(
            bytes(d[:32]) + bytes(d[64 : 64 + struct.unpack_from("<Q", d, 16)[0]])
        ).digest()

    assert "corrupt header: file size" in refused(damaged(tiny, grow), verify="none")


# ------------------------------------------------------------------------------------------ verify="once"


class HashSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = giw._sha256_hex

        def spy(data: Any) -> str:
            self.calls += 1
            return real(data)

        monkeypatch.setattr(giw, "_sha256_hex", spy)


def test_once_marker_skips_rehash(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy, cache = HashSpy(monkeypatch), tmp_path / "c"
    open_bundle(tiny, verify="once", cache_dir=cache).close()
    assert spy.calls == 4  # three tensors and the module
    assert len(list((cache / "verified").iterdir())) == 1
    with open_bundle(tiny, verify="once", cache_dir=cache) as b:
        assert spy.calls == 4  # the marker was found: nothing re-hashed
        assert b.verified is False
    open_bundle(tiny, verify="full", cache_dir=cache).close()
    assert spy.calls == 8  # "full" always hashes


def test_once_marker_invalidated_by_modification(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "c"
    open_bundle(tiny, verify="once", cache_dir=cache).close()
    # In place, same size: only the mtime tells, so make sure it moves even on a coarse clock.
    st = tiny.stat()
    with open(tiny, "r+b") as f:
        f.seek(blob_start(tiny, "tok_embd.weight"))
        f.write(b"\xff")
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert refused(tiny, "once") == "sha256 mismatch in tensor 'tok_embd.weight'"


def test_once_marker_invalidated_by_rebuild(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_bundle(tiny, verify="once").close()  # default cache: $GOINFER_CACHE
    assert len(list((tmp_path / "cache" / "verified").iterdir())) == 1
    manifest, tensors, modules = tiny_inputs()
    write_bundle(tiny, {**manifest, "quant": "q8"}, tensors, modules)
    spy = HashSpy(monkeypatch)
    open_bundle(tiny, verify="once").close()
    assert spy.calls == 4


def test_once_with_unwritable_cache_still_opens(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    spy = HashSpy(monkeypatch)
    for expect_calls in (4, 8):  # no marker could be written, so each open hashes everything again
        with open_bundle(tiny, verify="once", cache_dir=blocker) as b:  # cannot mkdir under a file
            assert b.verified and spy.calls == expect_calls
            assert b.tensor("blk.0.scales").tolist() == [1.5, -2.0]
    assert blocker.is_file() and blocker.read_text() == ""


# ------------------------------------------------------------------------------------------ modules


def test_extract_module_once(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "mods"
    with open_bundle(tiny, verify="none") as b:
        info = b.module_info("cpu")
        path = b.extract_module("cpu", dest)
        assert path == dest / f"{info.sha256}.so"
        assert path.read_bytes() == tiny_inputs()[2][0][2]
        assert sorted(p.name for p in dest.iterdir()) == [path.name]  # no temp left behind
        mtime = path.stat().st_mtime_ns
        spy = HashSpy(monkeypatch)
        assert b.extract_module("cpu", dest) == path  # reused: not hashed, not rewritten
        assert spy.calls == 0 and path.stat().st_mtime_ns == mtime


# ------------------------------------------------------------------------------------------ writing


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_unwritable_destination(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"^cannot write bundle .*No such file or directory$"):
        write_bundle(tmp_path / "no" / "such" / "dir.giw", *tiny_inputs())
    (tmp_path / "taken").mkdir()
    with pytest.raises(BundleError, match=r"^cannot write bundle .*taken: Is a directory$"):
        write_bundle(tmp_path / "taken", *tiny_inputs())
    assert listing(tmp_path) == ["taken"]  # the temp file was removed


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(giw.os, "fsync", full_disk)
    with pytest.raises(BundleError, match="No space left on device"):
        write_bundle(tmp_path / "x.giw", *tiny_inputs())
    assert listing(tmp_path) == []


def test_interrupted_input_leaves_nothing(tmp_path: Path) -> None:
    def tensors() -> Any:
        yield "a", np.zeros(3, np.float32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_bundle(tmp_path / "x.giw", {}, tensors())
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    ("manifest", "tensors", "modules", "expect"),
    [
        ({"tensors": []}, [], [], "manifest key 'tensors' is reserved"),
        ({"x": {1, 2}}, [], [], "not JSON-serializable"),
        ({"x": float("nan")}, [], [], "not JSON-serializable"),
        ({}, [("a", np.zeros(2, np.complex64))], [], "tensor 'a' has unsupported dtype complex64"),
        ({}, [("a", np.array(["s"]))], [], "unsupported dtype"),
        ({}, [("a", np.zeros(1)), ("a", np.zeros(1))], [], "duplicate tensor 'a'"),
        ({}, [("", np.zeros(1))], [], "non-empty string"),
        ({}, [], [("cpu", "llvm", b"")], "module 'cpu' target must be a dict"),
        ({}, [], [("cpu", {}, 42)], "module 'cpu' blob must be bytes-like"),
    ],
)
def test_bad_inputs(tmp_path: Path, manifest: dict, tensors: list, modules: list, expect: str) -> None:
    with pytest.raises(BundleError, match=expect):
        write_bundle(tmp_path / "x.giw", manifest, tensors, modules)
    assert listing(tmp_path) == []


def test_alignment_option(tmp_path: Path) -> None:
    path = tmp_path / "a64.giw"
    write_bundle(path, *tiny_inputs(), align=64)
    with open_bundle(path, verify="full") as b:
        assert all(b.tensor_info(n).file_offset % 64 == 0 for n in b.tensor_names())
        assert b.size < 2048  # vs 16 KiB at the default 4096
    with pytest.raises(BundleError, match="alignment must be a power of two"):
        write_bundle(path, *tiny_inputs(), align=100)
