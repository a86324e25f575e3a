"""The newer families' tiny folders through transformers itself (slow tier): its Qwen3, Llama (Llama 3.x
and YaRN rope_scaling), Phi-3 (fused weights, partial rotary, longrope, a window) and Mistral (a
window) against the numpy reference and against our bundle, at every position of a prompt that runs
past the scaled ropes' original context and the windows.

transformers runs in the reference venv (bench.reference_venv: torch is never the project's
dependency), one token at a time with its cache (tests/e2e/transformers_logits.py). Measured: min
cosine 0.9999998 against the reference on each model, max |logit difference| 2.4e-6.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from numerics_bars import F32_MIN_COSINE
from reference import reference_logits
from tiny_gguf import NEW_MODELS, ORIGINAL_CONTEXT, WINDOWS, tiny_vocab
from tiny_hf import write_tiny_hf_dir

from bench import reference_venv

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("transformers_logits.py")
TOKENS = 2 * max(ORIGINAL_CONTEXT, *WINDOWS.values()) + 8
REFERENCE_BAR = 0.999999  # two float implementations of the same formulas


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("model", NEW_MODELS)
def test_transformers_agrees_with_the_reference_and_our_bundle(
    model, tiny_gguf, tiny_bundle, tmp_path
) -> None:
    from goinfer.runtime.model import Model

    python = reference_venv.ensure()
    folder = write_tiny_hf_dir(tmp_path / model, model)
    ids = [int(i) for i in np.random.default_rng(5).integers(0, len(tiny_vocab(model)[0]), TOKENS)]
    out = tmp_path / "logits.npy"
    cmd = [str(python), str(SCRIPT), str(folder), json.dumps(ids), str(out)]
    run = subprocess.run(cmd, env=reference_venv.env(threads=2), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = np.load(out)
    ref = reference_logits(tiny_gguf(model), ids)
    ours = np.concatenate(list(Model.load(tiny_bundle(model, "f32")).prefill_logits(ids)), axis=0)
    vs_ref, vs_ours = _cos(theirs, ref), _cos(theirs, ours)
    print(f"\n{model}: transformers vs reference {vs_ref.min():.7f}, vs our bundle {vs_ours.min():.7f}")
    assert vs_ref.min() >= REFERENCE_BAR and vs_ours.min() >= F32_MIN_COSINE
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
