"""A local stand-in for the Hugging Face Hub, speaking the HTTP that huggingface_hub 2.x sends.

    server = HubServer({"o/r": {"config.json": b"{}", "m-Q4_K_M.gguf": b"GGUF..."}}, gated={"o/g"})
    with server:  # HF_ENDPOINT=server.url
        ...

What it serves, as the real Hub does for an anonymous client:

* ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (``?blobs=true``): the model
  info, with ``sha`` and ``siblings`` carrying ``size``, ``blobId`` (the git object id) and, for LFS
  files, ``lfs: {sha256, size, pointerSize}``; ``gated`` is "manual" for a gated repo.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: a small text file directly (``ETag`` = its blob id);
  an LFS file (.gguf, .safetensors, or anything over 64 KiB) as a 302 to a second port standing in
  for the CDN, with ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size`` on the redirect. Every
  resolve answer carries ``X-Repo-Commit``. ``Range`` gets 206 + ``Content-Range`` (416 past the end).
* Errors with the ``X-Error-Code`` huggingface_hub maps to exceptions: ``RepoNotFound`` (401, also
  for private repos), ``GatedRepo`` (401 on resolve), ``RevisionNotFound`` and ``EntryNotFound`` (404).

Knobs for the failure paths, each keyed by the file's path in its repo:
``cut_after[path] = n`` drops the connection after n body bytes, once (and with ``down_after_cut``
the server then drops every request unanswered until ``down`` is cleared); ``stall_after[path] = n``
sends n bytes, sets ``stalled`` and holds the connection until ``release()`` (a client killed
there is a pull killed mid-download); ``corrupt`` serves the file with one byte flipped while the
model info still advertises the right sha256. ``requests`` logs every request as a ``Hit``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

LFS_MIN_SIZE = 64 << 10
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_LFS = re.compile(r"^/lfs/(?P<sha>[0-9a-f]{64})/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True)
class Hit:
    method: str
    path: str  # unquoted, without the query
    range: str | None  # the Range header, if any
    status: int

    @property
    def is_weight(self) -> bool:
        return self.method == "GET" and self.path.endswith(LFS_SUFFIXES)


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    gated: bool = False
    private: bool = False
    commit: str = field(init=False)

    def __post_init__(self) -> None:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        self.commit = h.hexdigest()

    @staticmethod
    def is_lfs(name: str, data: bytes) -> bool:
        return name.endswith(LFS_SUFFIXES) or len(data) > LFS_MIN_SIZE

    def sibling(self, name: str) -> dict[str, object]:
        data = self.files[name]
        if not self.is_lfs(name, data):
            return {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
        sha = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
        lfs = {"sha256": sha, "size": len(data), "pointerSize": len(pointer)}
        return {"rfilename": name, "size": len(data), "blobId": git_blob_id(pointer), "lfs": lfs}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class HubServer:
    def __init__(
        self,
        repos: Mapping[str, Mapping[str, bytes]] | None = None,
        *,
        gated: Iterable[str] = (),
        private: Iterable[str] = (),
    ) -> None:
        self.repos: dict[str, FakeRepo] = {}
        gated, private = set(gated), set(private)
        for repo_id, files in (repos or {}).items():
            self.add(repo_id, files, gated=repo_id in gated, private=repo_id in private)
        self.requests: list[Hit] = []
        self.cut_after: dict[str, int] = {}
        self.stall_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.down = False  # True: every request is dropped unanswered (a Hub that went away mid-pull)
        self.down_after_cut = False  # set `down` when a cut_after fires
        self.stalled = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._servers: list[ThreadingHTTPServer] = []

    def add(
        self, repo_id: str, files: Mapping[str, bytes], *, gated: bool = False, private: bool = False
    ) -> FakeRepo:
        self.repos[repo_id] = FakeRepo(dict(files), gated=gated, private=private)
        return self.repos[repo_id]

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> HubServer:
        handler = _handler_for(self)
        for _ in range(2):  # the Hub, and the "CDN" its LFS redirects point to (another origin)
            srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self._servers.append(srv)
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection, as a Hub that went away would."""
        self._release.set()
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _abort(conn)
        self._servers.clear()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def release(self) -> None:
        """Let a stalled response go (it ends by dropping the connection)."""
        self._release.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    # queries for tests ---------------------------------------------------------------------------

    def hits(self, name: str | None = None, method: str | None = None) -> list[Hit]:
        """Logged requests, optionally those for files whose repo path is ``name`` (resolve or LFS)."""
        with self._lock:
            hits = list(self.requests)
        if name is not None:
            hits = [h for h in hits if h.path.endswith("/" + name) and "/api/" not in h.path]
        return [h for h in hits if method is None or h.method == method]

    def weight_gets(self) -> list[Hit]:
        return [h for h in self.hits() if h.is_weight]

    def file_requests(self) -> list[Hit]:
        """Every request for a file (resolve or LFS), as opposed to the model info."""
        return [h for h in self.hits() if not h.path.startswith("/api/")]

    def _log(self, hit: Hit) -> None:
        with self._lock:
            self.requests.append(hit)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)


def _abort(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects

        def setup(self) -> None:
            super().setup()
            hub._track(self.connection, True)

        def finish(self) -> None:
            hub._track(self.connection, False)
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, *_: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # routing ---------------------------------------------------------------------------------

        def _route(self, head: bool) -> None:
            path = self._path = unquote(urlsplit(self.path).path)
            if hub.down:
                hub._log(Hit(self.command, path, self.headers.get("Range"), 0))
                self.close_connection = True
                _abort(self.connection)
                return
            if m := _INFO.match(path):
                self._info(m["repo"], m["rev"] and unquote(m["rev"]))
            elif m := _RESOLVE.match(path):
                self._resolve(m["repo"], unquote(m["rev"]), m["path"], head)
            elif m := _LFS.match(path):
                self._lfs(m["sha"], m["path"], head)
            else:
                self._error(404, None, "Not Found")

        def send_response(self, code: int, message: str | None = None) -> None:
            # Logged before any byte of the answer leaves, so a client never sees an unlogged response.
            headers = getattr(self, "headers", None)
            path = getattr(self, "_path", None) or getattr(self, "path", "")
            hub._log(Hit(self.command, path, headers.get("Range") if headers else None, code))
            super().send_response(code, message)

        def _repo(self, repo_id: str, rev: str | None) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or repo.private:
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def _info(self, repo_id: str, rev: str | None) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            body = {
                "_id": repo.commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": repo.commit,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": [],
                "siblings": [repo.sibling(n) for n in sorted(repo.files)],
            }
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=False)

        def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            if repo.gated:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
                return
            data = repo.files.get(name)
            if data is None:
                self._error(404, "EntryNotFound", f"{name} does not exist on {rev}", commit=repo.commit)
                return
            headers = {"X-Repo-Commit": repo.commit}
            if not repo.is_lfs(name, data):
                headers["ETag"] = f'"{git_blob_id(data)}"'
                self._body(name, data, headers, head)
                return
            sha = hashlib.sha256(data).hexdigest()
            headers |= {
                "ETag": f'"{repo.sibling(name)["blobId"]}"',
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
                "Location": f"{hub.cdn_url}/lfs/{sha}/{quote(name)}",
            }
            self._send(302, b"Found. Redirecting", headers | {"Content-Type": "text/plain"}, head)

        def _lfs(self, sha: str, name: str, head: bool) -> None:
            for repo in hub.repos.values():
                data = repo.files.get(name)
                if data is not None and hashlib.sha256(data).hexdigest() == sha:
                    self._body(name, data, {"ETag": f'"{sha}"'}, head)
                    return
            self._error(404, None, "NoSuchKey")

        # answers ---------------------------------------------------------------------------------

        def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers, head=self.command == "HEAD")

        def _send(self, status: int, body: bytes, headers: Mapping[str, str], head: bool) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _body(self, name: str, data: bytes, headers: dict[str, str], head: bool) -> None:
            """A file's bytes, honouring Range and the cut / stall / corrupt knobs."""
            if name in hub.corrupt and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            total = len(data)
            start, end = 0, total - 1
            status = 200
            rng = self.headers.get("Range")
            if rng and (m := _RANGE.match(rng.strip())):
                if m[1]:
                    start, end = int(m[1]), min(int(m[2]) if m[2] else total - 1, total - 1)
                else:  # a suffix: the last n bytes
                    start = max(total - int(m[2] or 0), 0)
                if start >= total or start > end:
                    self._send(416, b"", headers | {"Content-Range": f"bytes */{total}"}, head)
                    return
                status = 206
                headers = headers | {"Content-Range": f"bytes {start}-{end}/{total}"}
            piece = data[start : end + 1]
            self.send_response(status)
            for k, v in (
                headers | {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            ).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(piece)))
            self.end_headers()
            if head:
                return
            if name in hub.cut_after:
                self._cut(piece[: hub.cut_after.pop(name)])
            elif name in hub.stall_after:
                self._stall(piece[: hub.stall_after.pop(name)])
            else:
                self.wfile.write(piece)

        def _cut(self, sent: bytes) -> None:
            self.wfile.write(sent)
            self.wfile.flush()
            hub.down = hub.down or hub.down_after_cut
            self.close_connection = True
            _abort(self.connection)

        def _stall(self, sent: bytes) -> None:
            self.wfile.write(sent)
            self.wfile.flush()
            hub.stalled.set()
            hub._release.wait(60)
            self.close_connection = True
            _abort(self.connection)

    return Handler
