"""BundleWriter: a bundle whose tensors arrive in pieces, in any order, from several threads, is
byte for byte what write_bundle makes of the same content; and a writer that fails leaves nothing."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from goinfer.artifacts import giw
from goinfer.artifacts.giw import BundleError, BundleWriter, open_bundle, write_bundle


def content() -> tuple[dict, list[tuple[str, np.ndarray]], list[tuple[str, dict, bytes]]]:
    rng = np.random.default_rng(0)
    manifest = {"family": "llama", "note": "héllo", "params": ["w", "b"]}
    tensors = [
        ("w", rng.integers(0, 2**32, (37, 24, 16), dtype=np.uint32)),  # rows of row blocks
        ("b", rng.standard_normal(100).astype(np.float32)),
        ("empty", np.zeros((0, 4), np.float16)),
        ("s", np.array(3, np.int8)),  # 0-d
        ("tok", np.frombuffer(b'{"model": {}}', np.uint8)),
    ]
    modules = [
        ("cpu", {"kind": "llvm"}, b"\x7fELF" + bytes(range(200))),
        ("st", {"kind": "llvm"}, b"x" * 5000),
    ]
    return manifest, tensors, modules


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def streamed(
    path: Path, *, plan: bool, manifest_for_plan: dict | None = None, step: int = 7
) -> giw.BundleInfo:
    """The content written in pieces of `step` rows, the tensors in reverse order, on threads."""
    manifest, tensors, modules = content()
    with BundleWriter(path) as w:
        for name, arr in tensors:
            w.add_tensor(name, arr.dtype, arr.shape)
        if plan:
            w.plan(manifest_for_plan or manifest, [(k, t, len(b)) for k, t, b in modules])

        def write(item: tuple[str, np.ndarray]) -> None:
            name, arr = item
            if arr.ndim == 0:
                w.write(name, arr)
                return
            for i in range(0, len(arr), step):
                w.write(name, arr[i : i + step])

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(write, reversed(tensors)))
        return w.finish(manifest, modules)


@pytest.mark.parametrize("plan", [True, False])
def test_streamed_bundle_is_byte_identical_to_write_bundle(tmp_path: Path, plan: bool) -> None:
    want = write_bundle(tmp_path / "a.giw", *content())
    got = streamed(tmp_path / "b.giw", plan=plan)
    a, b = (tmp_path / "a.giw").read_bytes(), (tmp_path / "b.giw").read_bytes()
    assert a == b
    assert got == want == giw.BundleInfo(len(a), hashlib.sha256(a).hexdigest())
    assert listing(tmp_path) == ["a.giw", "b.giw"]  # no temp file left


def test_a_plan_for_a_longer_manifest_moves_the_data_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest finish gets may differ in length from the planned one (here by a page): the
    data is moved to where that manifest puts it, and the bytes are the same."""
    moves = []
    monkeypatch.setattr(
        BundleWriter,
        "_move_data",
        lambda w, at, real=BundleWriter._move_data: moves.append(at) or real(w, at),
    )
    write_bundle(tmp_path / "a.giw", *content())
    assert not moves  # write_bundle plans exactly
    longer = {**content()[0], "pad": "x" * 5000}
    streamed(tmp_path / "b.giw", plan=True, manifest_for_plan=longer)
    assert moves == [4096]
    assert (tmp_path / "a.giw").read_bytes() == (tmp_path / "b.giw").read_bytes()
    assert listing(tmp_path) == ["a.giw", "b.giw"]


def test_tensors_read_back_before_finishing(tmp_path: Path) -> None:
    manifest, tensors, modules = content()
    with BundleWriter(tmp_path / "x.giw") as w:
        for name, arr in tensors:
            w.put(name, arr)
        assert all(np.array_equal(w.tensor(n), a) for n, a in tensors)
        w.finish(manifest, modules)
    with open_bundle(tmp_path / "x.giw", verify="full") as b:
        assert all(np.array_equal(b.tensor(n), a) for n, a in tensors)


def test_a_short_tensor_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    manifest, tensors, modules = content()
    w = BundleWriter(tmp_path / "x.giw")
    for name, arr in tensors:
        w.add_tensor(name, arr.dtype, arr.shape)
    w.write("w", tensors[0][1][:10])
    with pytest.raises(BundleError, match=r"tensor 'w' got 15360 of its 56832 bytes"):
        w.finish(manifest, modules)
    assert listing(tmp_path) == []


def test_misuse_is_refused(tmp_path: Path) -> None:
    with BundleWriter(tmp_path / "x.giw") as w:
        w.add_tensor("a", np.float32, (4,))
        with pytest.raises(BundleError, match="duplicate tensor 'a'"):
            w.add_tensor("a", np.float32, (4,))
        with pytest.raises(BundleError, match="unsupported dtype complex64"):
            w.add_tensor("c", np.complex64, (4,))
        with pytest.raises(BundleError, match="tensor 'b' was not declared"):
            w.write("b", np.zeros(4, np.float32))
        with pytest.raises(BundleError, match="tensor 'a' is float32, got a piece of int32"):
            w.write("a", np.zeros(4, np.int32))
        w.write("a", np.zeros(3, np.float32))
        with pytest.raises(BundleError, match="tensor 'a' is 16 bytes; got 24"):
            w.write("a", np.zeros(3, np.float32))
        with pytest.raises(BundleError, match="plan the bundle before writing"):
            w.plan({})
    assert listing(tmp_path) == []  # left without finish: dropped


def test_an_error_inside_the_with_block_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), BundleWriter(tmp_path / "x.giw") as w:
        w.put("a", np.arange(10))
        raise KeyboardInterrupt
    assert listing(tmp_path) == []


def test_moving_the_data_without_copy_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*_args: object) -> int:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(giw.os, "copy_file_range", unsupported, raising=False)
    monkeypatch.setattr(giw, "_CHUNK", 1000)  # several pieces through the buffer
    write_bundle(tmp_path / "a.giw", *content())
    longer = {**content()[0], "pad": "x" * 5000}  # planned a page further: the data moves
    streamed(tmp_path / "b.giw", plan=True, manifest_for_plan=longer)
    assert (tmp_path / "a.giw").read_bytes() == (tmp_path / "b.giw").read_bytes()
