"""/v1/files: uploads kept on disk for batches (OpenAI's Files API, purpose "batch").

    <batch dir>/files/<id>.jsonl   the bytes, as uploaded (or a batch's output, written whole)
    <batch dir>/files/<id>.json    its File object

Both are written by temp file, fsync and rename, content first: a File object on disk always has
its bytes. An upload streams to disk under --max-file-bytes (a 413 past it) and must be JSONL, one
request object a line (a 400 names the first bad line); a batch checks the lines themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from .batch_format import FormatError, fsync_dir, json_lines, write_atomic
from .errors import APIError, bad_request

PURPOSES = ("batch",)  # what may be uploaded; a batch's results are "batch_output"
ENVELOPE_SLACK = 64 * 1024  # multipart boundaries and headers around the file, within the body cap
routes = web.RouteTableDef()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _valid_id(file_id: str) -> bool:
    return file_id.startswith("file-") and file_id[5:].replace("-", "").isalnum() and len(file_id) < 100


class FileStore:
    def __init__(self, root: Path):
        self.dir = root / "files"

    def _meta(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    def content_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.jsonl"

    def get(self, file_id: str) -> dict[str, Any]:
        """The File object; a 404 for an id not here (or not one of ours)."""
        meta = self._meta(file_id) if _valid_id(file_id) else None
        try:
            if meta is not None:
                return json.loads(meta.read_text())
        except (OSError, ValueError):
            pass
        raise APIError(404, f"no file with id {file_id[:100]!r}", param="file_id", code="file_not_found")

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        out = []
        for meta in self.dir.glob("file-*.json") if self.dir.is_dir() else ():
            try:
                obj = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            if purpose is None or obj.get("purpose") == purpose:
                out.append(obj)
        return sorted(out, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def put(self, file_id: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """A file written whole (a batch's output): content, then its object."""
        write_atomic(self.content_path(file_id), data)
        return self._publish(file_id, filename, purpose, len(data))

    def _publish(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        write_atomic(self._meta(file_id), json.dumps(obj).encode())
        return obj

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self._meta(file_id).unlink(missing_ok=True)  # the object first: no object without bytes
        self.content_path(file_id).unlink(missing_ok=True)
        fsync_dir(self.dir)

    async def upload(self, request: web.Request, cap: int) -> dict[str, Any]:
        """A multipart upload (fields `purpose` and `file`), streamed to disk under `cap` bytes."""
        try:
            reader = await request.multipart()
        except (AssertionError, ValueError, KeyError):  # not multipart, or no boundary
            raise bad_request(
                "POST /v1/files takes multipart/form-data with fields 'purpose' and 'file'",
                code="invalid_multipart",
            ) from None
        self.dir.mkdir(parents=True, exist_ok=True)
        purpose, filename, tmp, size = None, "upload.jsonl", None, 0
        try:
            while (part := await _next_part(reader)) is not None:
                if part.name == "purpose":
                    purpose = (await part.read(decode=False))[:100].decode("utf-8", "replace").strip()
                elif part.name == "file" and tmp is None:
                    filename = (part.filename or filename)[:255]
                    tmp = self.dir / f".upload-{secrets.token_hex(6)}.tmp"
                    size = await _stream(part, tmp, cap)
                else:
                    await part.release()
            if purpose not in PURPOSES:
                raise bad_request(
                    f"purpose {purpose!r}: only 'batch' files are accepted here", "purpose", "invalid_purpose"
                )
            if tmp is None:
                raise bad_request("the 'file' field is missing", "file", "missing_file")
            await asyncio.to_thread(_check_jsonl, tmp)
            file_id = new_id("file")
            os.replace(tmp, self.content_path(file_id))
            tmp = None
            fsync_dir(self.dir)
            return self._publish(file_id, filename, purpose, size)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)


async def _next_part(reader: Any) -> Any:
    try:
        return await reader.next()
    except (ValueError, AssertionError, web.RequestPayloadError) as e:
        raise bad_request(f"the multipart body cannot be read: {e}", code="invalid_multipart") from None


async def _stream(part: Any, tmp: Path, cap: int) -> int:
    size = 0
    with open(tmp, "wb") as f:
        while chunk := await part.read_chunk(256 * 1024):
            size += len(chunk)
            if size > cap:
                raise APIError(
                    413, f"the file is over the {cap}-byte cap (--max-file-bytes)", code="file_too_large"
                )
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return size


def _check_jsonl(path: Path) -> None:
    with open(path, "rb") as f:
        try:
            if not sum(1 for _ in json_lines(f)):  # every line read: the first bad one is named
                raise bad_request(
                    "the file holds no lines: a batch file is JSONL, one request a line", "file"
                )
        except FormatError as e:
            raise bad_request(f"the file is not JSONL: {e}", param="file", code=e.code) from None
