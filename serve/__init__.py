"""goinfer.serve: the OpenAI- and Anthropic-compatible HTTP server (aiohttp) over the runtime.

One request, socket to kernel and back: middleware.py (envelope, auth, body caps) -> the API's
module (routes.py for OpenAI chat/completions, messages.py for Anthropic, responses.py) parses the
body (schemas.py) into a Job (job.py) -> pipeline.py (rules.py, prompt ids, limits, the compiled
constraint) -> registry.py (the model's queue and worker thread) -> Engine.generate, the one call
into the runtime -> deltas.py, tools/stream.py, confidence.py (the reply) -> chunks.py or the API's
event builder -> respond.py (SSE, or the folded reply).
"""
