"""Hashes of the compiler's own source: what a built module or bundle depends on beyond its inputs.

Keying caches on them means editing a kernel or a family file can never reuse a stale build, and
editing anything else does not throw a good one away:

- `codegen_fingerprint`, the compile cache's (compile_cache.py): only the source that shapes
  generated code. CODEGEN: kernels/ (the TIR), tvm/ (the pipeline, schedules and targets),
  models/ (the graph), quant/ (each scheme's parameters and the kernel that reads them), and the
  module defining ModelSpec (artifacts/manifest.py: its derived values, such as softmax_scale, go
  into the graph, and the page size the kernels lay out). Not
  sources/: what a checkpoint reader decides reaches the module only as the spec and the weight
  schemes, both in the key themselves. Not build.py or selftest.py: the one picks schemes and
  targets (in the key too) and writes the bundle, the other's kernel fixtures have their own key.
- `code_fingerprint`, the bundle key's (resolve.py): all of compiler/ and artifacts/, as a
  bundle also holds the packed weights, the tokenizer, the chat template and the manifest, written
  by artifacts/.
- `selftest_fingerprint`, the self-test libraries' (selftest.py): the codegen source and
  selftest.py.

Files are named relative to the package root (the folder holding compiler/ and artifacts/), so
two clones of the same tree share their caches.

Python files are hashed as their syntax tree without docstrings (comments never reach it), so an
edit to prose alone keeps every key; other files (templates) by their bytes.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
from collections.abc import Iterable
from pathlib import Path

_COMPILER_DIR = Path(__file__).resolve().parent
_ROOT = _COMPILER_DIR.parent  # compiler/, artifacts/, runtime/ ... (goinfer/ once installed)
_ARTIFACTS_DIR = _ROOT / "artifacts"
CODEGEN = ("kernels", "tvm", "models", "quant")  # relative to compiler/
_SUFFIXES = (".py", ".jinja")


def source_files(root: Path, parts: Iterable[str] | None = None) -> list[Path]:
    """The .py and template files under root (under `parts` of it, when given), sorted."""
    tops = [root / p for p in parts] if parts is not None else [root]
    found = [t for t in tops if t.is_file()]
    found += [p for t in tops if t.is_dir() for p in t.rglob("*") if p.is_file()]
    return sorted(p for p in found if p.suffix in _SUFFIXES and "__pycache__" not in p.parts)


def fingerprint(files: Iterable[Path], root: Path, base: str = "") -> str:
    """sha256 over each file's path relative to root (its absolute path if outside) and content,
    after `base` (another fingerprint this one extends) where given."""
    h = hashlib.sha256(base.encode() + b"\0" if base else b"")
    for path in files:
        name = path.relative_to(root) if path.is_relative_to(root) else path
        h.update(name.as_posix().encode() + b"\0")
        h.update(_content(path) + b"\0")
    return h.hexdigest()


@functools.cache
def codegen_fingerprint() -> str:
    files = source_files(_COMPILER_DIR, CODEGEN)
    spec_file = _model_spec_file()
    return fingerprint([*files, *([spec_file] if spec_file not in files else [])], _ROOT)


@functools.cache
def selftest_fingerprint() -> str:
    """The self-test libraries' (selftest.py): the codegen source and selftest.py, which picks
    the kernels and their fixture shapes."""
    return fingerprint([_COMPILER_DIR / "selftest.py"], _ROOT, codegen_fingerprint())


@functools.cache
def code_fingerprint() -> str:
    return fingerprint([*source_files(_COMPILER_DIR), *source_files(_ARTIFACTS_DIR)], _ROOT)


def _model_spec_file() -> Path:
    from goinfer.artifacts.manifest import ModelSpec

    return Path(inspect.getfile(ModelSpec)).resolve()


def _content(path: Path) -> bytes:
    data = path.read_bytes()
    return _syntax(data) if path.suffix == ".py" else data


def _syntax(source: bytes) -> bytes:
    """The module's syntax tree without docstrings (or any other string statement: no-ops)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not _is_string_statement(s)]
            node.body = kept or [ast.Pass()]
    return ast.dump(tree, include_attributes=False).encode()


def _is_string_statement(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )
