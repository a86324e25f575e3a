"""The paged KV cache's page, as the attention and append kernels lay it out.

Free of TVM, so the build can record it in the manifest without importing TVM.
"""

PAGE_SIZE = 16  # key/value slots per page: TVM's stock CPU kernels' layout, which ours keep
# The pages' element type unless a build asks otherwise (BuildOptions.kv_dtype): float16 halves
# the bytes a decode step reads per key (24 -> 12 KiB a token for Qwen2.5-0.5B); the kernels
# widen it to float32 on load and compute in float32. Qwen2.5-Coder-0.5B, 2 threads: decode at
# 4k tokens of context 39.9 -> 44.3 tok/s, at 16k 17.2 -> 20.4; perplexity with float32 weights
# 30.0275 -> 30.0283 (KL 2e-6 nats a token; in gguf mode the change is lost in the int8
# activations' rounding noise, which a 2^-20 nudge to q/k/v moves as much).
DEFAULT_KV_DTYPE = "float16"
