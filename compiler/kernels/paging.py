"""The paged KV cache's page, as the attention and append kernels lay it out.

Free of TVM, so the build can record it in the manifest without importing TVM.
"""

PAGE_SIZE = 16  # key/value slots per page: TVM's stock CPU kernels' layout, which ours keep
# The pages' element type unless a build asks otherwise (BuildOptions.kv_dtype): float16 halves
# the bytes a decode step reads per key (24 -> 12 KiB a token for Qwen2.5-0.5B); the kernels
# widen it to float32 on load and compute in float32.
DEFAULT_KV_DTYPE = "float16"
