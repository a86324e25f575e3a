"""The compile cache's key covers the source that generates code, and no prose: a docstring edit in
the zoo must not recompile every tiny model, a kernel edit must."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from goinfer.compiler import fingerprint

COMPILER = Path(fingerprint.__file__).resolve().parent


@pytest.fixture
def compiler_copy(tmp_path: Path) -> Path:
    root = tmp_path / "compiler"
    shutil.copytree(COMPILER, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _keys(root: Path) -> tuple[str, str]:
    """(the compile cache's key over root, the bundle cache's)."""
    codegen = fingerprint.fingerprint(fingerprint.source_files(root, fingerprint.CODEGEN), root)
    return codegen, fingerprint.fingerprint(fingerprint.source_files(root), root)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def test_prose_edits_keep_both_keys(compiler_copy: Path) -> None:
    before = _keys(compiler_copy)
    zoo, kernel = compiler_copy / "sources" / "zoo.py", compiler_copy / "kernels" / "affine.py"
    _edit(zoo, '"""', '"""Reworded: ')  # the module docstring
    _edit(kernel, "The ideas:", "The ideas, reworded:")  # a function's docstring
    _edit(kernel, "other core waiting", "other core idle")  # a TVMScript macro's docstring
    _edit(kernel, "PREFETCH_BYTES = 1024", "PREFETCH_BYTES = 1024  # a new comment\n# and another")
    assert _keys(compiler_copy) == before


def test_code_outside_the_codegen_files_keeps_the_compile_key(compiler_copy: Path) -> None:
    before = _keys(compiler_copy)
    zoo = compiler_copy / "sources" / "zoo.py"
    zoo.write_text(zoo.read_text() + "\nEXTRA = 1\n")
    after = _keys(compiler_copy)
    assert after[0] == before[0] and after[1] != before[1]  # a rebuilt bundle, the module reused


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        ("kernels/affine.py", "PREFETCH_BYTES = 1024", "PREFETCH_BYTES = 512"),
        ("tvm/schedules.py", "ROW_TILE = 16", "ROW_TILE = 32"),
        ("models/layers.py", "op_pattern", "op_pattern_"),
        ("quant/int4.py", '"int4"', '"int4x"'),
    ],
)
def test_code_in_the_codegen_files_changes_both_keys(
    compiler_copy: Path, path: str, old: str, new: str
) -> None:
    before = _keys(compiler_copy)
    _edit(compiler_copy / path, old, new)
    after = _keys(compiler_copy)
    assert after[0] != before[0] and after[1] != before[1]


def test_the_compile_key_covers_the_codegen_folders_and_the_model_spec() -> None:
    tops = {p.relative_to(COMPILER).parts[0] for p in fingerprint.source_files(COMPILER, fingerprint.CODEGEN)}
    assert tops == {"kernels", "tvm", "models", "quant"}
    assert fingerprint._model_spec_file().is_file()
    assert fingerprint.codegen_fingerprint() != fingerprint.code_fingerprint()
