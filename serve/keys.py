"""Typed application state (aiohttp AppKeys), shared by the routes."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from .config import BodyCaps, ServeConfig
from .engine import Engine
from .registry import Registry

# (name, path, quant or None) -> a loaded engine. Blocking; given by the composition root (cli),
# since turning a .gguf into a bundle needs the compiler, which serve never imports.
Loader = Callable[[str, str, "str | None"], Engine]

CONFIG = web.AppKey("config", ServeConfig)
CAPS = web.AppKey("caps", BodyCaps)
REGISTRY = web.AppKey("registry", Registry)
LOADER = web.AppKey("loader", object)  # a Loader, or None when admin loading is not offered
STARTED = web.AppKey("started", int)  # unix time the app was made: /v1/models' `created`
RESPONSES = web.AppKey("responses", object)  # a responses.ResponseStore: stored /v1/responses
