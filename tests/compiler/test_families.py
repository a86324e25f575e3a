"""The newer families (qwen3, llama with Llama 3.x and YaRN rope scaling, phi3, mistral) on their tiny
checkpoints (tiny_gguf.NEW_MODELS), from GGUF and from Hugging Face folders.

Each is held to the numpy reference (tests/reference: llama.cpp's graphs, transformers' RoPE
scalings) at f32 over a prompt that runs well past the scaled ropes' original context (64) and the
sliding windows (8, 48), then decodes; its folder gives the GGUF's logits exactly; every quant mode
a decoder builds in holds the bars tests/numerics_bars.py states. No real checkpoint of these
families can be fetched here, so these are the only checks against a model (README: Models).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from goinfer.compiler.sources.gguf_file import load_gguf
from goinfer.compiler.sources.hf_dir import load_dir
from numerics_bars import F32_MIN_COSINE, GGUF_BAR, INT_BARS
from reference import reference_logits
from tiny_gguf import NEW_MODELS, ORIGINAL_CONTEXT, WINDOWS, tiny_vocab
from tiny_hf import write_tiny_hf_dir
from tokenizers import Tokenizer

# twice past ORIGINAL_CONTEXT and every window, in several prefill chunks
PROMPT_TOKENS = 2 * max(ORIGINAL_CONTEXT, *WINDOWS.values()) + 8
DECODE_STEPS = 8
# int4mix keeps what a float checkpoint stores at >= 5 bits as int8: on these F32 files, int8's bar.
MIX_BARS = {**INT_BARS, "int4mix": INT_BARS["int8"]}
# gguf mode keeps the file's own blocks: each model on a block type the project reads exactly.
GGUF_TYPES = {"qwen3": "Q8_0", "llama3": "Q4_0", "yarn": "Q5_1", "phi3": "Q4_1", "mistral": "Q5_0"}


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _run(bundle: Path, prompt: list[int], continuation: list[int]) -> np.ndarray:
    from goinfer.runtime.model import Model

    m = Model.load(bundle)
    rows = list(m.prefill_logits(prompt))
    rows += [m.decode_step(t)[None] for t in continuation]
    return np.concatenate(rows, axis=0)


@pytest.fixture(scope="module")
def prompts(tiny_gguf) -> dict[str, tuple[list[int], list[int]]]:
    """Per model: random prompt ids, and the reference's greedy continuation of them."""
    out = {}
    for model in NEW_MODELS:
        vocab = len(tiny_vocab(model)[0])
        ids = [int(i) for i in np.random.default_rng(5).integers(0, vocab, PROMPT_TOKENS)]
        seq = list(ids)
        for _ in range(DECODE_STEPS):
            seq.append(int(np.argmax(reference_logits(tiny_gguf(model), seq)[-1])))
        out[model] = (ids, seq[len(ids) :])
    return out


@pytest.mark.parametrize("model", NEW_MODELS)
def test_same_model_from_gguf_and_folder(model, tiny_gguf, tmp_path) -> None:
    """Spec (RoPE tables, window, partial rotary), tensors, tokens, tokenizer and template alike; the
    one difference is Mistral's name, which its GGUFs spell "llama"."""
    gguf, hf = load_gguf(tiny_gguf(model)), load_dir(write_tiny_hf_dir(tmp_path / model, model))
    assert replace(hf.spec, family=gguf.spec.family) == gguf.spec
    assert hf.spec.family == ("mistral" if model == "mistral" else gguf.spec.family)
    assert (hf.tokens, hf.chat_template, sorted(hf.tensors)) == (
        gguf.tokens,
        gguf.chat_template,
        sorted(gguf.tensors),
    )
    for name, t in hf.tensors.items():
        assert np.array_equal(t.load(), gguf.tensors[name].load()), name
    # splits where the families' pre-tokenizers differ: digit runs, contractions, case, "/" after text
    text = "<|im_start|>user\nThe FOX's CamelCase, 12345 <think>héllo</think> x/y\n\n [INST] <|eot_id|>"
    toks = [Tokenizer.from_str(c.tokenizer_json) for c in (hf, gguf)]
    ids = [t.encode(text, add_special_tokens=False).ids for t in toks]
    assert ids[0] == ids[1]
    # the split itself (a tiny vocabulary can hide a wrong one): tekken, o200k, Llama 3's, Qwen's
    pieces = [[p for p, _ in t.pre_tokenizer.pre_tokenize_str(text)] for t in toks]
    assert pieces[0] == pieces[1]
    spec = gguf.spec
    want = {
        "qwen3": ("none", 0, 0, True),
        "llama3": ("llama3", 0, 0, False),
        "yarn": ("yarn", 0, 0, False),
        "phi3": ("longrope", WINDOWS["phi3"], 8, False),
        "mistral": ("none", WINDOWS["mistral"], 0, False),
    }[model]
    assert (spec.rope_scaling.kind, spec.sliding_window, spec.rope_dims, spec.qk_norm) == want
    assert "rope_freqs.weight" not in gguf.tensors  # the tables are in the spec, not weights


@pytest.mark.parametrize("model", NEW_MODELS)
def test_f32_matches_numpy_reference(model, tiny_bundle, tiny_gguf, prompts) -> None:
    ids, cont = prompts[model]
    ours = _run(tiny_bundle(model, "f32"), ids, cont)
    ref = reference_logits(tiny_gguf(model), ids + cont)
    cos = _cos(ours, ref)
    print(f"\n{model} f32 vs reference: min cosine {cos.min():.7f} over {len(cos)} positions")
    assert cos.min() >= F32_MIN_COSINE, np.round(cos, 6)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("model", NEW_MODELS)
def test_the_folder_gives_the_gguf_logits(model, tiny_bundle, prompts, tmp_path) -> None:
    """The same checkpoint as a Hugging Face folder (fused names, rope_scaling in config.json, the
    window in config.json) builds to the same model: identical logits."""
    from goinfer.compiler.build import BuildOptions, build

    folder = write_tiny_hf_dir(tmp_path / model, model)
    hf_bundle = tmp_path / f"{model}-hf.giw"
    build(folder, hf_bundle, BuildOptions(quant="f32", num_cores=2, kv_dtype="float32"), progress=print)
    ids, cont = prompts[model]
    got, want = _run(hf_bundle, ids, cont), _run(tiny_bundle(model, "f32"), ids, cont)
    assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("quant", list(MIX_BARS))
@pytest.mark.parametrize("model", NEW_MODELS)
def test_int_modes_hold_their_bar_against_f32(model, quant, tiny_bundle, prompts) -> None:
    ids, cont = prompts[model]
    f32 = _run(tiny_bundle(model, "f32"), ids, cont)
    q = _run(tiny_bundle(model, quant), ids, cont)
    cos, top1 = _cos(q, f32), float((q.argmax(-1) == f32.argmax(-1)).mean())
    min_cos, min_top1 = MIX_BARS[quant]
    print(f"\n{model} {quant} vs f32: min cosine {cos.min():.4f} (bar {min_cos}), top-1 {top1:.2f}")
    assert cos.min() >= min_cos and top1 >= min_top1


@pytest.mark.parametrize("model", NEW_MODELS)
def test_q8_0_mode_holds_the_gguf_bar(model, tiny_bundle, tiny_gguf, prompts) -> None:
    """q8_0 re-quantizes the float image to GGUF's Q8_0 blocks: against the f32 reference."""
    ids, cont = prompts[model]
    ours = _run(tiny_bundle(model, "q8_0"), ids, cont)
    ref = reference_logits(tiny_gguf(model), ids + cont)
    cos, agree = _cos(ours, ref), float((ours.argmax(-1) == ref.argmax(-1)).mean())
    print(f"\n{model} q8_0 vs reference: min cosine {cos.min():.6f}, top-1 {agree:.2f}")
    assert cos.min() >= GGUF_BAR[0] and agree >= GGUF_BAR[1]


@pytest.mark.parametrize("model", NEW_MODELS)
def test_gguf_mode_matches_the_reference_of_its_own_file(model, tiny_bundle, tiny_gguf, prompts) -> None:
    ids, cont = prompts[model]
    tensor_type = GGUF_TYPES[model]
    ours = _run(tiny_bundle(model, "gguf", tensor_type), ids, cont)
    ref = reference_logits(tiny_gguf(model, tensor_type), ids + cont)
    cos, agree = _cos(ours, ref), float((ours.argmax(-1) == ref.argmax(-1)).mean())
    print(f"\n{model} gguf {tensor_type} vs reference: min cosine {cos.min():.6f}, top-1 {agree:.2f}")
    assert cos.min() >= GGUF_BAR[0] and agree >= GGUF_BAR[1]
