"""The forward entry points take token ids and return logits; older bundles' are still called
their own way (an `embed` entry, then entry points that take embeddings and return the cache too)."""

from __future__ import annotations

import numpy as np
import pytest


def test_new_bundles_take_ids_and_decode_matches_a_full_prefill(tiny_bundle) -> None:
    from goinfer.runtime.model import Model

    m = Model.load(tiny_bundle("llama", "f32"))
    assert m.manifest["forward_input"] == "token_ids"
    assert "embed" not in m.manifest["entry_points"]
    ids = [3, 17, 5, 42, 9]
    want = m.prefill(ids, all_logits=True)
    m.prefill(ids[:2])
    got = [m.decode_step(t) for t in ids[2:]]  # the one-token path reuses one input tensor
    np.testing.assert_allclose(np.stack(got), want[2:], rtol=1e-4, atol=1e-4)


def test_a_bundle_from_before_token_ids_goes_through_embed(tiny_bundle) -> None:
    """Stand-in entry points with the old contract: embed gives (n, hidden) rows carrying the id;
    the forward takes (1, n, hidden) and returns (logits, cache), logits one-hot at the id."""
    from goinfer.artifacts import giw
    from goinfer.runtime import tvm_runtime as rt
    from goinfer.runtime.model import Model, tokenizer_json

    real = Model.load(tiny_bundle("llama", "f32"))
    bundle = giw.open_bundle(real.bundle.path)
    bundle.manifest = {k: v for k, v in bundle.manifest.items() if k != "forward_input"}
    bundle.manifest["entry_points"] = ["embed", "prefill", "prefill_all", "decode", "create_kv_cache"]
    vocab, hidden = int(real.spec["vocab_size"]), real.hidden
    calls: list[str] = []

    def embed(ids, _params):
        calls.append("embed")
        rows = np.from_dlpack(ids).astype(np.float32)
        return rt.tensor(np.repeat(rows[:, None], hidden, axis=1))

    def forward(name: str):
        def run(emb, kv, _params):
            calls.append(name)
            x = np.from_dlpack(emb)
            assert x.shape[0] == 1 and x.shape[2] == hidden
            logits = np.zeros((1, x.shape[1], vocab), np.float32)
            logits[0, np.arange(x.shape[1]), x[0, :, 0].astype(int)] = 1.0
            return rt.tensor(logits[:, -1:] if name == "prefill" else logits), kv

        return run

    vm = {"embed": embed, "create_kv_cache": real.vm["create_kv_cache"]}
    vm |= {name: forward(name) for name in ("prefill", "prefill_all", "decode")}
    old = Model(bundle, vm, real.params, real.tokenizer, tokenizer_json(bundle), 0.0)
    assert int(np.argmax(old.prefill([4, 8, 15]))) == 15
    assert int(np.argmax(old.decode_step(23))) == 23
    assert calls == ["embed", "prefill", "embed", "decode"]


def test_an_entry_point_the_module_lacks_is_refused_by_name(tiny_bundle) -> None:
    from goinfer.artifacts import giw
    from goinfer.runtime.model import Model, tokenizer_json

    real = Model.load(tiny_bundle("llama", "f32"))
    bundle = giw.open_bundle(real.bundle.path)
    bundle.manifest = {**bundle.manifest, "entry_points": [*bundle.manifest["entry_points"], "verify"]}
    with pytest.raises(giw.BundleError, match="'verify'"):
        Model(bundle, real.vm, real.params, real.tokenizer, tokenizer_json(bundle), 0.0)
