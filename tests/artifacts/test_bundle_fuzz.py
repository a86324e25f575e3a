"""Seeded fuzzing of the bundle reader: any damaged file opens cleanly or raises BundleError.

With verify="full" every byte of a bundle is checked (header checksum, blob hashes, zero
padding, exact length), so any change at all must be refused; with verify="none" a damaged
blob may go unnoticed, but nothing may raise anything other than BundleError. A third kind of
mutation edits the manifest and then re-signs it, to reach the checks behind the checksum.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from goinfer.artifacts.giw import BundleError, open_bundle, write_bundle
from goinfer.artifacts.manifest import describe
from sample_manifest import sample

ITERATIONS = 400
SEED = 20240601


def _bundle(path: Path) -> bytes:
    tensors = [
        ("w", np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)),
        ("q", np.arange(40, dtype=np.uint8)),
        ("s", np.float16(0.5)),
        ("e", np.zeros((0, 5), np.int32)),
        ("tokenizer.json", np.frombuffer(b'{"model": {}}', np.uint8)),
        ("st.in0", np.ones(3, np.float32)),
        ("st.want", np.ones(3, np.float32)),
    ]
    modules = [("llvm", {"kind": "llvm"}, bytes(range(50))), ("selftest@avx2", {"kind": "llvm"}, b"st")]
    # The typed manifest, so re-signed manifest edits reach its checks too; dense alignment: more hits.
    write_bundle(path, sample().to_json(), tensors, modules, align=64)
    return path.read_bytes()


def _resign(data: bytearray) -> bytearray:
    """Recompute the header checksum (and manifest length is whatever the header now says)."""
    if len(data) >= 64:
        mlen = struct.unpack_from("<Q", data, 16)[0]
        data[32:64] = hashlib.sha256(bytes(data[:32]) + bytes(data[64 : 64 + mlen])).digest()
    return data


def _mutators(rng: random.Random) -> list[Callable[[bytearray], bytearray]]:
    def flip(d: bytearray) -> bytearray:
        for _ in range(rng.randint(1, 3)):
            d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)
        return d

    def poke(d: bytearray) -> bytearray:
        d[rng.randrange(len(d))] = rng.randrange(256)
        return d

    def truncate(d: bytearray) -> bytearray:
        return d[: rng.randrange(len(d))]

    def extend(d: bytearray) -> bytearray:
        return d + rng.randbytes(rng.randint(1, 200))

    def splice(d: bytearray) -> bytearray:
        i = rng.randrange(len(d))
        return d[:i] + rng.randbytes(rng.randint(0, 16)) + d[i + rng.randint(0, 16) :]

    def header_field(d: bytearray) -> bytearray:
        off, fmt = rng.choice([(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q")])
        top = (1 << 8 * struct.calcsize(fmt)) - 1
        struct.pack_into(fmt, d, off, rng.choice([0, 1, 63, 64, 4096, len(d), 2**31, top]))
        return d

    def manifest_edit(d: bytearray) -> bytearray:
        # Change the manifest text (digits, quotes, brackets) and re-sign, as a forger would.
        mlen = struct.unpack_from("<Q", d, 16)[0]
        for _ in range(rng.randint(1, 3)):
            i = 64 + rng.randrange(mlen)
            d[i] = ord(rng.choice('0123456789-",:[]{}ae'))
        return _resign(d)

    def manifest_resize(d: bytearray) -> bytearray:
        # Insert or delete manifest bytes, fix the length and the checksum: the data then shifts.
        mlen = struct.unpack_from("<Q", d, 16)[0]
        i, n = 64 + rng.randrange(mlen), rng.randint(1, 8)
        if rng.random() < 0.5:
            new = d[:i] + bytes(rng.choice(b"0 9,") for _ in range(n)) + d[i:]
        else:
            new = d[:i] + d[i + n :]
        struct.pack_into("<Q", new, 16, mlen + len(new) - len(d))
        return _resign(new)

    return [flip, poke, truncate, extend, splice, header_field, manifest_edit, manifest_resize]


def _read_everything(path: Path, verify: str) -> None:
    with open_bundle(path, verify=verify) as b:  # type: ignore[arg-type]
        for name in b.tensor_names():
            t = b.tensor(name)
            assert t.nbytes == b.tensor_info(name).nbytes
            np.asarray(t).sum()  # touches every byte
        for key in b.module_keys():
            assert len(b.module_bytes(key)) == b.module_info(key).nbytes
        describe(b)


def test_fuzz_reader(tmp_path: Path) -> None:
    original = _bundle(tmp_path / "ok.giw")
    rng = random.Random(SEED)
    mutators = _mutators(rng)
    target, counts = tmp_path / "fuzz.giw", {"opened": 0, "refused": 0}
    for it in range(ITERATIONS):
        mutate = rng.choice(mutators)
        data = bytes(mutate(bytearray(original)))
        verify = rng.choice(["full", "none"])
        target.write_bytes(data)
        try:
            _read_everything(target, verify)
        except BundleError as e:
            assert str(e) and "\n" not in str(e)
            counts["refused"] += 1
            continue
        except Exception as e:  # the property under test: nothing else escapes
            pytest.fail(f"iteration {it} ({mutate.__name__}, verify={verify}): {type(e).__name__}: {e}")
        counts["opened"] += 1
        resigned = mutate.__name__.startswith("manifest")  # a forged manifest can be valid
        if verify == "full" and data != original and not resigned:
            pytest.fail(f"iteration {it} ({mutate.__name__}): a changed file passed full verification")
    assert counts["refused"] > ITERATIONS // 2, counts
