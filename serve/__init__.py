"""goinfer.serve: the OpenAI-compatible HTTP server (aiohttp) over the runtime.

One request, socket to kernel and back: middleware.py (envelope, auth, body caps) -> routes.py ->
schemas.py (pydantic) -> plan.py (limits, sampling) -> registry.py (the model's queue and worker
thread) -> runtime.stream over Engine.generate -> chunks.py -> respond.py (SSE, or the folded reply).
"""
