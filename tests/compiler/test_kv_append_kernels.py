"""Our KV-cache split and append kernels against TVM's stock ones they replace, on the same inputs:
one token (the serial decode path) and a chunk long enough to run in parallel, slots skipped
(position -1), and head_dims that are no multiple of a vector; in both KV cache dtypes (float16:
every buffer half, a copy as in float32)."""

from __future__ import annotations

import numpy as np
import pytest

PAGE = 16
# float16 on one shape a test: the kernels only copy, in whatever dtype the cache has
APPEND_CASES = [(3, 64, "float32"), (1, 256, "float32"), (2, 40, "float32"), (2, 40, "float16")]
SPLIT_CASES = [(9, 3, 64, "float32"), (4, 1, 256, "float32"), (6, 2, 40, "float32"), (9, 3, 64, "float16")]


@pytest.fixture(scope="module")
def build():
    import tvm
    from goinfer.compiler.tvm import targets

    target = targets.make_target(targets.host_target(2))

    def compile_(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, target=target)["main"]

    return compile_


def _t(a):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a))


@pytest.mark.parametrize("h_kv,d,dtype", APPEND_CASES)
@pytest.mark.parametrize("ntoken", [1, 300])
def test_append_matches_the_stock_kernel(build, h_kv, d, dtype, ntoken):
    from goinfer.compiler.kernels import kv_append
    from tvm.relax.frontend.nn.llm import kv_cache

    rng = np.random.default_rng(ntoken * 7 + d)
    n_pages = (ntoken + PAGE - 1) // PAGE + 3
    pages = rng.standard_normal((n_pages, 2, h_kv, PAGE, d)).astype(dtype)
    k = rng.standard_normal((ntoken, h_kv, d)).astype(dtype)
    v = rng.standard_normal((ntoken, h_kv, d)).astype(dtype)
    slots = rng.permutation(n_pages * PAGE)[:ntoken].astype(np.int32)
    slots[::5] = -1  # tokens the cache does not keep
    out = {}
    for name, func in (
        ("stock", kv_cache._kv_cache_transpose_append(h_kv, d, dtype)),
        ("ours", kv_append.transpose_append(h_kv, d, dtype)),
    ):
        p = _t(pages)
        build(func)(p, _t(k), _t(v), _t(slots))
        out[name] = p.numpy()
    np.testing.assert_array_equal(out["ours"], out["stock"])
    for i in np.flatnonzero(slots >= 0)[:3]:  # and what both did is the append itself
        page, slot = divmod(int(slots[i]), PAGE)
        np.testing.assert_array_equal(out["ours"][page, 0, :, slot], k[i])
        np.testing.assert_array_equal(out["ours"][page, 1, :, slot], v[i])


@pytest.mark.parametrize("h_q,h_kv,d,dtype", SPLIT_CASES)
@pytest.mark.parametrize("seq_len", [1, 300])
def test_split_matches_the_stock_kernel_without_rope(build, h_q, h_kv, d, dtype, seq_len):
    from goinfer.compiler.kernels import kv_append
    from tvm.relax.frontend.nn.llm import position_embedding

    rng = np.random.default_rng(seq_len + d)
    qkv = rng.standard_normal((seq_len, h_q + 2 * h_kv, d)).astype(dtype)
    pos = np.arange(seq_len, dtype=np.int32)
    stock = position_embedding.llama_rope_with_position_map(10000, 1, d, h_q, h_kv, dtype, {}, d)
    outs = {}
    for name, func in (("stock", stock), ("ours", kv_append.split_qkv(h_q, h_kv, d, dtype))):
        q, k, v = (_t(np.full((seq_len, h, d), np.nan, dtype)) for h in (h_q, h_kv, h_kv))
        build(func)(_t(qkv), _t(pos), q, k, v, 0)
        outs[name] = [q.numpy(), k.numpy(), v.numpy()]
    for got, want in zip(outs["ours"], outs["stock"], strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(outs["ours"][1], qkv[:, h_q : h_q + h_kv])


def test_split_refuses_rope(build):
    """The cache is built with RopeMode.NONE: a call asking for RoPE is a wiring bug, not a no-op."""
    from goinfer.compiler.kernels import kv_append

    h_q, h_kv, d = 2, 1, 16
    qkv = np.zeros((1, h_q + 2 * h_kv, d), np.float32)
    outs = [_t(np.zeros((1, h, d), np.float32)) for h in (h_q, h_kv, h_kv)]
    args = [_t(qkv), _t(np.zeros(1, np.int32)), *outs]
    with pytest.raises(Exception, match="RoPE"):
        build(kv_append.split_qkv(h_q, h_kv, d))(*args, 1)
