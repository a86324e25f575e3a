"""The KServe v2 Open Inference Protocol front end: gRPC (grpc_server.py) and REST (rest.py).

Both speak the LLM tensor convention of Triton's vLLM backend (llm.py) and run a request through
the same pipeline a /v1/completions request takes (run.py): the same slots, scheduler and prefix
reuse, no second engine.
"""
