"""The matmul shape every scheme shares: K split as (word, lane) so the schedule can keep one
accumulator per lane (rfactor) and dequantize a whole packed word at a time."""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx

from ..lower import tvm_api

LANES = 8  # one int4 word holds 8 nibbles; f32/int8 use the same split so one schedule fits all


def lane_matmul(x: te.Tensor, out_features, product: Callable, dtype: str = "float32") -> te.Tensor:
    """out[i, n] = sum over (ko, ki) of product(i, n, ko, ki), with k = ko * LANES + ki."""
    m, kdim = x.shape
    ko = te.reduce_axis((0, kdim // LANES), name="ko")
    ki = te.reduce_axis((0, LANES), name="ki")
    return te.compute(
        (m, out_features), lambda i, n: te.sum(product(i, n, ko, ki), axis=[ko, ki]), name="qmatmul"
    )


def prefetch_ahead(
    w, block, word, ahead: int, words: int, task_blocks: int, once: bool = False
) -> tirx.PrimExpr:
    """Prefetch w[block, word + ahead, 0], w being a kernel's (blocks, words, 16) row-block weights
    read along `words`; `once` (decode, where a call reads each weight once) makes it
    non-temporal on the CPUs where that pays (`tvm_api.specialize`: AMD Zen, not Intel).

    Non-temporal, decode's weight stream (the whole model, every token) stops pushing out of the
    caches what a decode step keeps using: the code, the VM's and Python's objects, activations
    and the KV cache. Decode on Zen 3, ms a token (two bundles interleaved in one process, median
    of 16-40; logits identical): SmolLM2 int4 3.42 -> 3.26, int8int8 5.25 -> 4.94, Qwen-0.5B int4
    11.17 -> 10.86. On a Xeon it was the other way: with it, SmolLM2 int4 took 5.88 ms a token
    against 2.16, Qwen-0.5B 20.1 against 9.7. A GEMM panel reads its weights again for each
    token tile, so prefill keeps the ordinary prefetch.

    Near a block's end, the line ahead falls in the next block. A task reads `task_blocks`
    consecutive blocks side by side and a thread's next task the `task_blocks` after them, so
    skip to the same block of that next task; otherwise the first lines of each task but one go
    unprefetched. With 4.6-5 KB blocks (K = 576, 640) that was a fifth of the weights: int4 decode
    GEMVs at two blocks a task 3-10% faster on every model's shapes (SmolLM2, Gemma-3, Qwen-0.5B;
    A/B in one process).
    """
    skip = tirx.if_then_else(word + ahead >= words, task_blocks - 1, 0) if task_blocks > 1 else 0
    return tvm_api.prefetch_read(tirx.address_of(w[block + skip, word + ahead, 0]), once)
