"""`goinfer cache`: what the pull and bundle caches hold, and whether each pull finished; the web
page's "On disk" card (GET /web/models/cache) shows the same list.

    hub/<owner>--<repo>/<sel>/           a published hf: pull (its marker lists the files it checked)
    hub/<owner>--<repo>/.partial-<sel>/  a pull that did not finish: the next one resumes it
    models/<file>                        a zoo checkpoint (its .sha256-ok marker: verified)
    models/.pull-<name>-*/               a zoo pull that was killed: the next one starts again
    bundles/<model>.<quant>.<target>.<key>.giw   a built bundle; .<name>.*.tmp: a build not finished

Only stats and small JSON files are read (markers, bundle manifests): listing never hashes a
checkpoint nor calls the network.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
from goinfer.artifacts import cache

from .errors import fail


@dataclass(frozen=True)
class Entry:
    kind: str  # "hub" | "zoo" | "bundle"
    name: str  # hf:owner/repo:SEL, the zoo name, the bundle's file name
    path: str
    size: int  # bytes on disk
    complete: bool  # a pull that finished and verifies; a bundle renamed into place and readable
    detail: str
    ref: str | None  # what the Models tab's Load (a bundle) or Pull (a checkpoint) takes; None: neither
    # a bundle this goinfer would not build now (an older compiler, other options): never picked
    # again by `serve MODEL`, so its space can be had back
    stale: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def entries(cache_root: Path | None = None) -> list[Entry]:
    return [*_hub(cache_root), *_zoo(cache_root), *_bundles(cache_root)]


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# -- hf: pulls ---------------------------------------------------------------------------------------
def _hub(cache_root: Path | None) -> list[Entry]:
    from goinfer.compiler.sources import hub

    out = []
    for repo in sorted(p for p in cache.folder("hub", cache_root).glob("*--*") if p.is_dir()):
        for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".stale-")):
            if folder.name.startswith(".partial-"):
                out.append(_partial_pull(hub, repo, folder))
            elif not folder.name.startswith("."):
                out.append(_published_pull(hub, repo, folder))
    return out


def _ref_of(hub, repo: Path, dirname: str) -> str:
    """The hf: reference a pull folder holds, from its names (`<owner>--<repo>/<sel>[@<rev>]`)."""
    selector, _, revision = dirname.partition("@")
    owner, _, name = repo.name.partition("--")
    return str(hub.HubRef(f"{owner}/{name}", selector, revision or "main"))


def _published_pull(hub, repo: Path, folder: Path) -> Entry:
    try:
        marker = json.loads((folder / hub.MARKER).read_text())
        ref = hub.HubRef(marker["repo"], marker["selector"], marker.get("revision") or "main")
        files, commit = marker["files"], str(marker.get("commit", ""))[:12]
        kind, family = marker.get("kind", "?"), marker.get("family")
    except (OSError, ValueError, KeyError, TypeError):
        ref_text = _ref_of(hub, repo, folder.name)
        why = "no readable marker: not a finished pull (a pull of it starts again)"
        return Entry("hub", ref_text, str(folder), _size(folder), False, why, ref_text)
    complete = hub.cached(ref, _root_of(repo)) is not None
    what = f"{kind}{f' ({family})' if family else ''}, {len(files)} file{'s' * (len(files) != 1)}"
    detail = f"{what}, commit {commit}" if complete else f"{what}: a file is missing or changed size"
    return Entry("hub", str(ref), str(folder), _size(folder), complete, detail, str(ref))


def _partial_pull(hub, repo: Path, folder: Path) -> Entry:
    ref = _ref_of(hub, repo, folder.name.removeprefix(".partial-"))
    parts = [p for p in folder.rglob("*") if p.is_file() and p.name != hub.STAGING_STATE]
    done = [p for p in parts if not p.name.endswith(hub.PARTIAL)]
    started = len(parts) - len(done)
    detail = f"not finished: {len(done)} files fetched" + (f", {started} in progress" if started else "")
    return Entry("hub", ref, str(folder), _size(folder), False, f"{detail}; a pull of it resumes", ref)


def _root_of(repo_folder: Path) -> Path:
    return repo_folder.parent.parent  # <root>/hub/<owner>--<repo>


# -- zoo checkpoints ---------------------------------------------------------------------------------
def _zoo(cache_root: Path | None) -> list[Entry]:
    from goinfer.compiler.sources import zoo

    models = cache.folder("models", cache_root)
    out = []
    for name in zoo.names():
        model = zoo.ZOO[name]
        path = models / model.filename
        if not path.exists():
            continue
        complete = zoo.cached(name, cache_root) is not None
        state = "verified" if complete else "not verified yet (its next use hashes it)"
        detail = f"{model.description}, {state}"
        out.append(Entry("zoo", name, str(path), _size(path), complete, detail, name))
    for tmp in sorted(models.glob(".pull-*")) if models.is_dir() else ():
        name = next((n for n in zoo.names() if tmp.name.startswith(f".pull-{n}-")), tmp.name)
        why = "an interrupted pull (a pull of it starts again; this folder can be deleted)"
        out.append(Entry("zoo", name, str(tmp), _size(tmp), False, why, name if name in zoo.ZOO else None))
    return out


# -- bundles -----------------------------------------------------------------------------------------
def _bundles(cache_root: Path | None) -> list[Entry]:
    folder = cache.folder("bundles", cache_root)
    if not folder.is_dir():
        return []
    out = [_bundle(p) for p in sorted(folder.glob("*.giw"))]
    for tmp in sorted(folder.glob(".*.giw.*.tmp")):
        name = tmp.name[1:].split(".giw.")[0] + ".giw"
        why = "a build that has not finished (running, or killed: then this file can be deleted)"
        out.append(Entry("bundle", name, str(tmp), _size(tmp), False, why, None))
    return out


def _bundle(path: Path) -> Entry:
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest

    size = _size(path)
    try:
        with giw.open_bundle(path, verify="none") as b:  # the header and manifest only
            m = Manifest.of(b)
    except (OSError, ValueError) as e:  # BundleError is a ValueError: an older format, a damaged file
        return Entry("bundle", path.name, str(path), size, False, f"not loadable: {e}", None, stale=True)
    what = (
        f"{m.model.family} {m.kind}, {m.build.quant}, {m.build.target}, context {m.model.context_length}, "
        f"from {m.source.ref}"
    )
    stale = _key_in_name(path) != _current_key(m)
    if stale:
        what += "; stale: this goinfer would build it anew"
    if m.kind != "decoder":
        return Entry("bundle", path.name, str(path), size, True, f"{what}; serve --embed-model", None, stale)
    return Entry("bundle", path.name, str(path), size, True, what, str(path), stale)


def _key_in_name(path: Path) -> str:
    return path.name.removesuffix(".giw").rsplit(".", 1)[-1]  # <model>.<quant>.<target>.<key>.giw


def _current_key(m) -> str:
    """The key this goinfer gives the bundle of this checkpoint and these options (resolve.py)."""
    from goinfer.compiler.build import BuildOptions
    from goinfer.compiler.resolve import bundle_key

    arch = next((g.arch for g in m.gpu_modules if g.kind == "cuda"), BuildOptions.cuda_arch)
    kv = m.kv_cache.dtype if m.kv_cache is not None else BuildOptions.kv_dtype
    options = BuildOptions(target=m.build.target, quant=m.build.quant, kv_dtype=kv, cuda_arch=arch)
    return bundle_key(m.source.sha256, options)


# -- the command -------------------------------------------------------------------------------------
@click.command("cache")
@click.option("--json", "as_json", is_flag=True, help="the list as JSON")
def cache_command(as_json: bool) -> None:
    """List what the pull and bundle caches hold ($GOINFER_CACHE, default ~/.cache/goinfer): hf:
    pulls, zoo checkpoints and built bundles, with sizes and whether each pull finished."""
    try:
        found = entries()
    except OSError as e:
        fail(f"cannot read the cache at {cache.root()}: {e.strerror or e}")
    if as_json:
        click.echo(json.dumps([e.to_json() for e in found], indent=1))
        return
    root = cache.root()
    stale = sum(e.size for e in found if e.stale)
    click.echo(
        f"goinfer cache at {root}: {len(found)} entries, {_mb(sum(e.size for e in found))}"
        + (f" ({_mb(stale)} in stale bundles)" if stale else "")
    )
    for e in found:
        path = Path(e.path)
        shown = path.relative_to(root) if path.is_relative_to(root) else path
        state = "stale" if e.stale else "complete" if e.complete else "incomplete"
        click.echo(f"  {e.kind:<6}  {state:<10}  {_mb(e.size):>10}  {e.name}")
        click.echo(f"  {'':<6}  {'':<10}  {'':>10}  {shown}: {e.detail}")
