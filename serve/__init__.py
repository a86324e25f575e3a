"""goinfer.serve: the OpenAI- and Anthropic-compatible HTTP server (aiohttp) over the runtime.

One request, socket to kernel and back: middleware.py (envelope, origins, auth, body caps, reading
and validating the body) -> the API's module (routes.py for OpenAI chat/completions, messages.py
for Anthropic, responses.py), which spells the request as a Job -> pipeline.py (rules, prompt ids,
the compiled constraint, the plan) -> registry.py (the model's queue and worker thread) ->
Engine.generate (model_engine.py), the one call into the runtime -> events.py, tools/stream.py,
confidence.py (the reply) -> events.py again (the API's events: SSE, or the folded JSON reply).

An embedding request takes its own path: embeddings.py (inputs, prompt, ids) -> embed_queue.py
(the encoder's own queue and worker thread, batching across requests) -> Embedder.embed_ids.
"""
