"""The forward entry points take token ids and return logits; the manifest names them all."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest


def test_decode_steps_match_a_full_prefill(tiny_bundle) -> None:
    from goinfer.runtime.model import Model

    m = Model.load(tiny_bundle("llama", "f32"))
    assert "embed" not in m.manifest.entry_points
    ids = [3, 17, 5, 42, 9]
    want = np.concatenate(list(m.prefill_logits(ids)))
    m.prefill(ids[:2])
    got = [m.decode_step(t) for t in ids[2:]]  # the one-token path reuses one input tensor
    np.testing.assert_allclose(np.stack(got), want[2:], rtol=1e-4, atol=1e-4)


def test_an_entry_point_the_module_lacks_is_refused_by_name(tiny_bundle) -> None:
    from goinfer.artifacts import giw
    from goinfer.runtime.model import Model

    real = Model.load(tiny_bundle("llama", "f32"))
    manifest = dataclasses.replace(real.manifest, entry_points=(*real.manifest.entry_points, "verify"))
    with pytest.raises(giw.BundleError, match="'verify'"):
        Model(real.bundle, manifest, real.vm, real.params, real.tokenizer, "{}", 0.0)
