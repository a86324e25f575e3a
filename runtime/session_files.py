"""--session-dir: warm sessions saved as requests finish, restored when the server starts.

Saving runs in two halves: the KV export reads the cache, so it runs on the scheduler's thread
(a memory copy: ~10 ms for 4k tokens of Qwen-0.5B); writing the file runs on a writer thread of
its own, off every request's path. A session is saved only when it grew since its last save, and
its file goes when the pool drops it.

Restoring, before the server takes requests: the newest sessions first, up to --kv-sessions.
TVM's checkpoint import empties the cache it imports into, so one session (the newest with KV)
comes back by import, exactly as it was; the others are re-prefilled from their saved ids once,
at startup. A model whose cache TVM cannot export (sliding-window layers: Gemma 3) saves ids only,
and all its sessions are re-prefilled at startup.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from . import session_store as store
from .kv_pool import KVPool, Seq

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger("goinfer.runtime")


class SessionFiles:
    def __init__(self, root: str, bundle_id: str):
        self.root, self.bundle_id = root, bundle_id
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goinfer-sessions")

    def save(self, pool: KVPool, seq: Seq) -> None:
        """(scheduler thread) Snapshot `seq` and queue its file; nothing if it has not grown."""
        if len(seq.tokens) <= seq.saved:
            return
        try:
            kv = pool.export(seq)
        except Exception as e:  # a session not saved must not fail the requests around it
            log.warning("could not export session %s: %s", seq.key, e)
            kv = None
        saved = store.SavedSession(seq.key, list(seq.tokens), seq.last_used, *(kv or (None, [])))
        seq.saved = len(seq.tokens)
        self._writer.submit(self._write, saved)

    def _write(self, saved: store.SavedSession) -> None:
        try:
            store.save(self.root, self.bundle_id, saved)
        except OSError as e:
            log.warning("could not save session %s under %s: %s", saved.key, self.root, e)

    def forget(self, seq: Seq) -> None:
        self._writer.submit(store.remove, self.root, self.bundle_id, seq.key)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def restore(self, sched: Scheduler) -> None:
        """(before the scheduler starts) The newest saved sessions, warm in the pool again."""
        loaded = []
        for path in store.listing(self.root, self.bundle_id):
            try:
                loaded.append(store.load(path, self.bundle_id))
            except (OSError, store.SessionFileError) as e:
                log.warning("session file %s refused: %s", path, e)
        loaded.sort(key=lambda s: s.last_used, reverse=True)
        keep, window = loaded[: sched.config.kv_sessions], sched.model.context_length
        keep = [s for s in keep if 0 < len(s.tokens) < window]
        if not keep:
            return
        t0, imported, refed = time.perf_counter(), 0, 0
        first = next((s for s in keep if s.kv_metadata is not None), None)
        if first is not None:
            try:
                sched.pool.adopt_import(
                    first.tokens, first.kv_metadata, list(first.kv_groups), first.key, first.last_used
                )
                imported = 1
            except Exception as e:  # the cache's layout changed (another --kv-dtype): re-prefill it
                log.warning("session %s: KV import refused (%s); re-prefilling its ids", first.key, e)
                first = None
        for s in keep:
            if s is first:
                continue
            if not sched.pool.make_room(sched.pool.pages_for(Seq(-1), len(s.tokens)) + 1):
                break  # the rest would not fit the cache
            seq = sched.pool.new_warm(s.key, s.last_used)
            for at in range(0, len(s.tokens), sched.chunk):
                piece = s.tokens[at : at + sched.chunk]
                sched.model.run(sched.pool.kv, [seq.id], [piece])
                seq.tokens.extend(piece)
            seq.busy, seq.saved = False, len(seq.tokens)
            refed += 1
        log.info(
            "restored %d sessions from %s in %.1fs (%d by KV import, %d re-prefilled)",
            imported + refed,
            store.folder(self.root, self.bundle_id),
            time.perf_counter() - t0,
            imported,
            refed,
        )
