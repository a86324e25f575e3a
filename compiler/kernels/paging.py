"""The paged KV cache's page, as the attention and append kernels lay it out.

Free of TVM, so the build can record it in the manifest without importing TVM.
"""

PAGE_SIZE = 16  # key/value slots per page: TVM's stock CPU kernels' layout, which ours keep
