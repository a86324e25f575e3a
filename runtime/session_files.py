"""--session-dir: the warm sessions' files, written off every request's path and read back whole.

A pure store over session_store.py's format: it knows nothing of the cache or the scheduler. The
scheduler hands it `SavedSession`s to write (ids after each request; ids and KV at shutdown), the
keys of sessions the pool dropped, and at start asks it for every session it holds. A file that
cannot be read, or that the scheduler refuses, is moved aside (renamed `*.refused`, with the reason
logged once): it is never loaded again, and never crashes a start.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import session_store as store

log = logging.getLogger("goinfer.runtime")
REFUSED = ".refused"
READERS = 2  # session files read and checked at once at start


class SessionFiles:
    def __init__(self, root: str, bundle_id: str):
        self.root, self.bundle_id = root, bundle_id
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goinfer-sessions")

    @property
    def folder(self) -> Path:
        return store.folder(self.root, self.bundle_id)

    def write(self, saved: store.SavedSession) -> None:
        """Queue `saved`'s file on the writer thread (atomic: the old file or the new one)."""
        self._writer.submit(self._write, saved)

    def _write(self, saved: store.SavedSession) -> None:
        try:
            store.save(self.root, self.bundle_id, saved)
        except OSError as e:
            log.warning("could not save session %s under %s: %s", saved.key, self.root, e)

    def forget(self, key: str) -> None:
        self._writer.submit(store.remove, self.root, self.bundle_id, key)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def load_all(self) -> list[store.SavedSession]:
        """Every session this bundle's folder holds, newest first; unreadable files set aside.
        Temporary files a killed save left behind are removed: their sessions' last good files
        (if any) are what counts."""
        for tmp in self.folder.glob(f".*{store.SUFFIX}.tmp") if self.folder.is_dir() else ():
            tmp.unlink(missing_ok=True)

        def load(path: Path) -> store.SavedSession | str:
            try:
                return store.load(path, self.bundle_id)
            except (OSError, store.SessionFileError) as e:
                return str(e)

        paths = store.listing(self.root, self.bundle_id)
        with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="goinfer-restore") as pool:
            loaded = list(pool.map(load, paths))  # hashing releases the GIL: files check in parallel
        out = []
        for path, got in zip(paths, loaded, strict=True):
            if isinstance(got, str):
                self.set_aside(path.stem, got)
            else:
                out.append(got)
        return sorted(out, key=lambda s: s.last_used, reverse=True)

    def set_aside(self, key: str, why: str) -> None:
        """Refuse a session for good: one log line, and its file renamed out of the listing."""
        path = self.folder / f"{key}{store.SUFFIX}"
        log.warning("session file %s refused: %s (moved aside as %s%s)", path, why, path.name, REFUSED)
        try:
            path.replace(path.with_name(path.name + REFUSED))
        except OSError as e:  # a read-only folder: it stays, and is refused again next start
            log.warning("could not move %s aside: %s", path, e)
