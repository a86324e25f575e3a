"""Reading a named-event SSE body (the Anthropic and Responses streams) in tests."""

from __future__ import annotations

import json
from typing import Any


def named_events(raw: str) -> list[dict[str, Any]]:
    """Each event's data; checks that the stream has no [DONE] and that each event is named by its
    data's type. Keep-alive comments (`: keep-alive`, sent while nothing is ready) are skipped."""
    assert "[DONE]" not in raw
    out = []
    for block in raw.strip().split("\n\n"):
        if block.startswith(":"):
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append(data)
    return out
