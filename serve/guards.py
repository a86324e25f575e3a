"""Halts: the swap guard and an admin's halt, which stop new generations and let running ones finish.

While halted, every generation route (chat, completions, messages, responses, systemone,
embeddings) answers 503 with code `halted` and the reason, in its own API's envelope: the
registry asks `Halt.reason()` before it routes a request (registry.py). Nothing running is
cancelled. /health says `halted` and why.

The swap guard measures swap used at start (its baseline) and trips once it has grown past the
threshold (GOINFER_SWAP_GUARD, MB or off; SwapGuardConfig): a machine that has started to swap serves
every token slowly, and more requests only make it worse. It lets go once swap has stayed back
within the threshold for `recover_s` (30 s), so a brief dip does not reopen the gate.
The meminfo source and the clock are injectable: the tests drive both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any, TypeVar

from aiohttp import web
from goinfer.runtime.fit import meminfo, proc_meminfo

from .config import SwapGuardConfig
from .errors import APIError

log = logging.getLogger("goinfer.serve")
MB = 1 << 20
T = TypeVar("T")

MeminfoSource = Callable[[], str]  # the text of /proc/meminfo
Clock = Callable[[], float]


def swap_used_mb(read: MeminfoSource = proc_meminfo) -> float | None:
    """SwapTotal - SwapFree in MB; None where there is no /proc/meminfo (not Linux)."""
    try:
        m = meminfo(read())
    except OSError:
        return None
    if "SwapTotal" not in m or "SwapFree" not in m:
        return None
    return (m["SwapTotal"] - m["SwapFree"]) / MB


def halted_error(reason: str) -> APIError:
    # The message starts with the code: Anthropic's envelope carries no `code`, and a client reading
    # either envelope sees "halted" and why.
    return APIError(503, f"halted: {reason}", code="halted", headers={"Retry-After": "30"})


class SwapGuard:
    def __init__(
        self, config: SwapGuardConfig, source: MeminfoSource = proc_meminfo, clock: Clock = time.monotonic
    ):
        self.config, self.source, self.clock = config, source, clock
        self.baseline = swap_used_mb(source) if config.threshold_mb is not None else None
        self.tripped: str | None = None  # the reason while tripped
        self._back_since: float | None = None  # when swap came back within the threshold

    @property
    def armed(self) -> bool:
        return self.config.threshold_mb is not None and self.baseline is not None

    def describe(self) -> str:
        """The startup line."""
        if self.config.threshold_mb is None:
            return "swap guard: off (GOINFER_SWAP_GUARD=off)"
        if self.baseline is None:
            return "swap guard: off (no /proc/meminfo swap figures on this system)"
        return (
            f"swap guard: armed, threshold +{self.config.threshold_mb} MB over baseline "
            f"(swap used {self.baseline:.0f} MB)"
        )

    def poll(self) -> str | None:
        """Read swap once and update the state; the reason while tripped, else None."""
        if not self.armed:
            return None
        used = swap_used_mb(self.source)
        if used is None:  # a failed read changes nothing
            return self.tripped
        grew, limit = used - self.baseline, self.config.threshold_mb  # type: ignore[operator]
        if grew > limit:  # type: ignore[operator]
            if self.tripped is None:
                log.warning("swap guard tripped: swap used grew %.0f MB (threshold +%d MB)", grew, limit)
            self.tripped = (
                f"swap guard tripped: swap used grew {grew:.0f} MB over its baseline of "
                f"{self.baseline:.0f} MB (threshold +{limit} MB); new requests are refused until it "
                f"has stayed back within the threshold for {self.config.recover_s:g} s"
            )
            self._back_since = None
        elif self.tripped is not None:
            now = self.clock()
            if self._back_since is None:
                self._back_since = now
            elif now - self._back_since >= self.config.recover_s:
                log.info(
                    "swap guard: swap back within the threshold for %gs: serving again",
                    now - self._back_since,
                )
                self.tripped, self._back_since = None, None
        return self.tripped


class Halt:
    """Why new generations are refused now, if they are: an admin's halt or the swap guard."""

    def __init__(self, swap: SwapGuard):
        self.swap = swap
        self.admin: str | None = None  # the admin's reason while halted by POST /admin/halt

    def cause(self) -> tuple[str, str] | None:
        """(by, reason): "admin" first, since it outlasts a swap trip."""
        if self.admin is not None:
            return "admin", self.admin
        if self.swap.tripped is not None:
            return "swap guard", self.swap.tripped
        return None

    def reason(self) -> str | None:
        cause = self.cause()
        return cause[1] if cause else None

    def check(self) -> None:
        """Raise the 503 while halted (registry.py calls this before routing a generation)."""
        reason = self.reason()
        if reason is not None:
            raise halted_error(reason)

    def health(self) -> dict[str, Any] | None:
        cause = self.cause()
        return {"by": cause[0], "reason": cause[1]} if cause else None


HALT = web.AppKey("halt", Halt)


async def monitor(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the swap guard's poll loop, for the app's life."""
    guard = app[HALT].swap
    task = asyncio.create_task(_watch(guard)) if guard.armed else None
    yield
    if task is not None:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


async def _watch(guard: SwapGuard) -> None:
    while True:
        guard.poll()  # a read of /proc/meminfo: microseconds, fine on the loop
        await asyncio.sleep(guard.config.poll_s)


def load_guarded(
    config: SwapGuardConfig,
    load: Callable[[], T],
    terms: str,
    close: Callable[[T], None],
    source: MeminfoSource = proc_meminfo,
) -> T:
    """Run a model load; if swap used grew past the threshold meanwhile, free it and refuse in one
    line naming the growth and the model's priced memory terms (runtime/fit.py's Price)."""
    before = swap_used_mb(source) if config.threshold_mb is not None else None
    result = load()
    after = swap_used_mb(source) if before is not None else None
    if before is not None and after is not None and after - before > config.threshold_mb:  # type: ignore[operator]
        close(result)
        raise ValueError(
            f"the load made swap used grow {after - before:.0f} MB (swap guard threshold "
            f"+{config.threshold_mb} MB); priced: {terms}; free memory or pass a smaller --ctx"
        )
    return result
