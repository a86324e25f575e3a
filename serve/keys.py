"""Typed application state (aiohttp AppKeys), shared by the routes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from .config import BodyCaps, ServeConfig
from .engine import Engine
from .registry import Registry

if TYPE_CHECKING:
    from .responses import ResponseStore

# (name, path, quant or None) -> a loaded engine. Blocking; given by the composition root (cli),
# since turning a .gguf into a bundle needs the compiler, which serve never imports.
Loader = Callable[[str, str, "str | None"], Engine]

CONFIG = web.AppKey("config", ServeConfig)
CAPS = web.AppKey("caps", BodyCaps)
REGISTRY = web.AppKey("registry", Registry)
# None when admin loading is not offered. (The key's type lives in its annotation: a Callable is
# no runtime class to hand AppKey.)
LOADER: web.AppKey[Loader | None] = web.AppKey("loader")
STARTED = web.AppKey("started", int)  # unix time the app was made: /v1/models' `created`
RESPONSES: web.AppKey[ResponseStore] = web.AppKey("responses")  # stored /v1/responses
# --decisions-calibration's temperatures by question kind ({}: none), read once at start
CALIBRATION: web.AppKey[dict[str, float]] = web.AppKey("calibration")
