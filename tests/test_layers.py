"""The layering: serve -> runtime -> artifacts <- compiler, nothing pointing back up, and no import
cycle inside serve/ or runtime/ (a type-only import under TYPE_CHECKING does not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"serve": "goinfer.serve", "runtime": "goinfer.runtime", "compiler": "goinfer.compiler",
            "artifacts": "goinfer.artifacts", "cli": "goinfer.cli"}  # fmt: skip
NEVER = {  # what each package must not import
    "runtime": ("goinfer.serve", "goinfer.compiler", "goinfer.cli"),
    "serve": ("goinfer.compiler", "goinfer.cli"),
    "artifacts": ("goinfer.runtime", "goinfer.serve", "goinfer.compiler", "goinfer.cli"),
    "compiler": ("goinfer.runtime", "goinfer.serve", "goinfer.cli"),
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    """Modules `path` imports at run time (absolute names; TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    skip = {id(n) for node in guarded for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from . import x` names a module
    return out


def _graph(package: str) -> dict[str, set[str]]:
    files = {_module(p): p for p in (ROOT / package).rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


@pytest.mark.parametrize("package", sorted(NEVER))
def test_imports_point_one_way(package: str) -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(i for i in _imports(p) if i.startswith(NEVER[package]))
        for p in (ROOT / package).rglob("*.py")
    }
    assert not {f: i for f, i in bad.items() if i}


@pytest.mark.parametrize("package", ["serve", "runtime"])
def test_no_import_cycle(package: str) -> None:
    graph = _graph(package)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_pyproject_lists_every_package() -> None:
    """setuptools installs only the packages pyproject names: a renamed or new folder left out
    breaks `pip install -e` on a clean clone (it did: compiler/lower -> compiler/tvm)."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {_module(p) for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert set(tool["packages"]) == on_disk
