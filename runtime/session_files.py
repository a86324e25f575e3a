"""--session-dir: warm sessions saved as requests finish, restored when the server starts.

After each request its session's token ids are written (cheap, and all a crash can lose is KV
that can be recomputed); at shutdown every warm session is written again with its KV pages. The
writes run on a writer thread of their own, off every request's path, and a session's file goes
when the pool drops it.

Restoring, before the server takes requests: the newest sessions first, up to --kv-sessions.
TVM's checkpoint import empties the cache it imports into, so one session (the newest saved with
its KV) comes back by import, exactly as it was; the others are re-prefilled from their ids once,
at startup, in the chunks a cold run uses (so they are exact too). A model whose cache TVM cannot
export (sliding-window layers: Gemma 3) saves ids only, and all its sessions are re-prefilled.
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

    def save(self, pool: KVPool, seq: Seq, with_kv: bool = False) -> None:
        """(scheduler thread) Queue `seq`'s file: its ids, and its KV with `with_kv` (at shutdown
        only: exporting splits the sequence, see KVPool.export). Nothing if it has not grown."""
        if len(seq.tokens) <= seq.saved and not with_kv:
            return
        kv = None
        if with_kv:
            try:
                kv = pool.export(seq)
            except Exception as e:  # a session not saved must not fail anything around it
                log.warning("could not export session %s: %s", seq.key, e)
        meta, groups = kv or (None, [])
        saved = store.SavedSession(seq.key, list(seq.tokens), seq.last_used, seq.exact, meta, tuple(groups))
        seq.saved = len(seq.tokens)
        self._writer.submit(self._write, saved)

    def save_all(self, pool: KVPool) -> None:
        """(after the scheduler stopped) Every warm session, with its KV; sequence 0 first, as the
        others' exports go through it."""
        for seq in sorted((s for s in pool.seqs.values() if not s.busy), key=lambda s: s.id != 0):
            self.save(pool, seq, with_kv=True)

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
            for at in range(0, len(s.tokens), sched.chunk):  # a cold run's chunks: exact
                piece = s.tokens[at : at + sched.chunk]
                sched.model.run(sched.pool.kv, [seq.id], [piece])
                seq.tokens.extend(piece)
            seq.busy, seq.saved = False, len(seq.tokens)
            seq.exact = len(seq.tokens) - len(seq.tokens) % sched.chunk
            refed += 1
        log.info(
            "restored %d sessions from %s in %.1fs (%d by KV import, %d re-prefilled)",
            imported + refed,
            store.folder(self.root, self.bundle_id),
            time.perf_counter() - t0,
            imported,
            refed,
        )
