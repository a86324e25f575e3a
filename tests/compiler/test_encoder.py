"""Encoders end to end on tiny checkpoints the test writes (tests/tiny_encoder.py): the HF folder
read, built through TVM, loaded by runtime/encoder.py, and held to the numpy forward read
straight from the folder (tests/reference/encoder.py). The real model (all-MiniLM-L6-v2 against
sentence-transformers) is in tests/e2e/test_embed_reference.py."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from reference.encoder import Reference
from tiny_encoder import HIDDEN, POSITIONS, PROMPTS, write_tiny_encoder

TEXTS = [
    "the way you use it",
    "def sort(self, key): return list(dict)",
    "A",
    "how many people come to look at the long thing? one, two...",
    "search the document for words",
]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory):
    """(family, pooling, quant) -> (folder, Encoder), built once."""
    from goinfer.compiler.build import BuildOptions, build
    from goinfer.runtime.encoder import Encoder

    made: dict = {}

    def get(family: str, pooling: str = "mean", quant: str = "f32"):
        key = (family, pooling, quant)
        if key not in made:
            root = tmp_path_factory.mktemp("enc")
            folder = write_tiny_encoder(root / f"{family}-{pooling}", family, pooling)
            out = root / f"{family}-{pooling}-{quant}.giw"
            build(folder, out, BuildOptions(quant=quant, num_cores=2), progress=lambda _m: None)
            made[key] = (folder, Encoder.load(out))
        return made[key]

    return get


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("family", ["bert", "nomic_bert"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_f32_matches_the_numpy_forward(encoders, family: str, pooling: str) -> None:
    folder, enc = encoders(family, pooling)
    ids = [enc.tokenize(t) for t in TEXTS]
    got = enc.embed_ids(ids)
    want = Reference(folder).embed(ids)
    assert got.shape == (len(TEXTS), HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, want).min() > 0.99999, _cosines(got, want)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("family", ["bert", "nomic_bert"])
def test_q8_0_stays_close(encoders, family: str) -> None:
    folder, enc = encoders(family, quant="q8_0")
    ids = [enc.tokenize(t) for t in TEXTS]
    assert _cosines(enc.embed_ids(ids), Reference(folder).embed(ids)).min() > 0.999


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_a_vector_is_the_same_alone_or_batched(encoders, quant: str) -> None:
    """Exactness: packing inputs together changes no bit of any input's vector, whatever its
    neighbours and its place; split across forwards too."""
    _folder, enc = encoders("bert", quant=quant)
    ids = [enc.tokenize(t) for t in TEXTS]
    together = enc.embed_ids(ids)
    alone = np.stack([enc.embed_ids([x])[0] for x in ids])
    reversed_ = enc.embed_ids(ids[::-1])[::-1]
    assert np.array_equal(together, alone) and np.array_equal(together, reversed_)
    small = type(enc.config)(max_batch_tokens=12)  # forces several forwards
    enc.config, old = small, enc.config
    try:
        assert enc._forwards([len(x) for x in ids]) != [(0, len(ids))]
        assert np.array_equal(enc.embed_ids(ids), together)
    finally:
        enc.config = old


def test_the_manifest_says_encoder(encoders) -> None:
    _folder, enc = encoders("nomic_bert")
    m = enc.manifest
    assert m.kind == "encoder" and m.entry_points == ("embed",) and m.kv_cache is None
    assert m.embedding.pooling == "mean" and m.embedding.dimensions == HIDDEN
    assert m.embedding.max_tokens == POSITIONS and dict(m.embedding.prompts) == PROMPTS
    assert enc.prompts == PROMPTS and enc.dimensions == HIDDEN and enc.max_tokens == POSITIONS


def test_tokens_truncation_and_refusals(encoders) -> None:
    from goinfer.runtime.encoder import EncoderInputError

    _folder, enc = encoders("bert")
    ids = enc.tokenize("the way")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    long = enc.tokenize(" ".join(["the"] * 100))
    cut = enc.truncate(long)
    assert len(cut) == POSITIONS and cut[0] == 2 and cut[-1] == 3 and cut[1:-1] == long[1 : POSITIONS - 1]
    assert enc.truncate(ids) == ids
    with pytest.raises(EncoderInputError, match=f"input 1 has 102 tokens; bert takes at most {POSITIONS}"):
        enc.embed_ids([ids, long])
    with pytest.raises(EncoderInputError, match="input 0 is empty"):
        enc.embed_ids([[]])
    with pytest.raises(EncoderInputError, match="token id 99999 is outside the vocabulary"):
        enc.embed_ids([[2, 99999, 3]])
    assert enc.embed_ids([]).shape == (0, HIDDEN)


def test_bundles_of_the_other_kind_are_refused(encoders, tiny_bundle) -> None:
    from goinfer.artifacts.giw import BundleError
    from goinfer.runtime.encoder import Encoder
    from goinfer.runtime.model import Model

    _folder, enc = encoders("bert")
    with pytest.raises(BundleError, match="is an encoder \\(bert\\), not a generative model"):
        Model.load(enc.bundle.path)
    with pytest.raises(BundleError, match="is a decoder \\(llama\\), not an embedding model"):
        Encoder.load(tiny_bundle("llama"))


def _refused(folder: Path, match: str, **options) -> None:
    from goinfer.compiler.build import BuildError, BuildOptions, build
    from goinfer.compiler.sources.base import SourceError

    with pytest.raises((SourceError, BuildError), match=match):
        build(
            folder, folder.parent / "out.giw", BuildOptions(num_cores=2, **options), progress=lambda _m: None
        )


def test_what_the_build_refuses(tmp_path: Path) -> None:
    good = write_tiny_encoder(tmp_path / "good", "bert")
    _refused(good, "encoders build for llvm only, not cuda", target="llvm,cuda")
    _refused(good, "--quant int8int8 is not offered for encoders \\(choose f32 or q8_0", quant="int8int8")

    def variant(name: str, edit) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def set_config(**keys):
        def edit(folder: Path) -> None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(cfg | keys))

        return edit

    _refused(variant("act", set_config(hidden_act="relu")), "hidden_act 'relu' is not supported")
    _refused(variant("pos", set_config(position_embedding_type="relative_key")), "absolute only")
    _refused(variant("heads", set_config(num_attention_heads=5)), "not a multiple of 5 heads")
    _refused(variant("vocab", set_config(vocab_size=7)), "vocab_size is 7")
    _refused(variant("layers", set_config(num_hidden_layers=3)), "missing tensor blk.2")

    def max_pooling(folder: Path) -> None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))

    _refused(variant("pool", max_pooling), "pooling pooling_mode_max_tokens is not supported")

    def no_post_processor(folder: Path) -> None:
        tok = json.loads((folder / "tokenizer.json").read_text())
        (folder / "tokenizer.json").write_text(json.dumps(tok | {"post_processor": None}))

    _refused(variant("post", no_post_processor), "no post_processor")
    _refused(variant("modules", lambda f: (f / "modules.json").write_text("{")), "modules.json: not JSON")


def test_a_folder_without_pooling_files_pools_the_mean(tmp_path: Path) -> None:
    from goinfer.compiler.sources import load_checkpoint

    folder = write_tiny_encoder(tmp_path / "plain", "bert", pooling="cls")
    (folder / "modules.json").unlink()  # a plain HF BertModel: sentence-transformers means it
    ckpt = load_checkpoint(folder)
    assert ckpt.embedding.pooling == "mean" and ckpt.embedding.prompts == {}
    assert ckpt.chat_template == "" and ckpt.tokens.stop_ids == ()


def test_corrupt_encoder_manifests_are_refused(encoders) -> None:
    from goinfer.artifacts.giw import BundleError
    from goinfer.artifacts.manifest import Manifest

    _folder, enc = encoders("bert")
    good = enc.manifest.to_json()
    bad = {
        "kind": ({**good, "kind": "oracle"}, "kind is 'oracle'"),
        "no embedding": ({**good, "embedding": None}, "missing embedding for a encoder"),
        "kv cache": ({**good, "kv_cache": {"page_size": 16, "prefill_chunk": 8}}, "a kv_cache for a encoder"),
        "pooling": ({**good, "embedding": {**good["embedding"], "pooling": "max"}}, "pooling is 'max'"),
        "width": ({**good, "embedding": {**good["embedding"], "dimensions": 0}}, "dimensions is 0"),
        "entry": ({**good, "entry_points": ["decode"]}, "entry_points lacks embed"),
        "decoder": ({**good, "kind": "decoder"}, "missing kv_cache for a decoder"),
    }
    for manifest, match in bad.values():
        with pytest.raises(BundleError, match=match):
            Manifest.from_json(manifest)


@pytest.mark.parametrize("shape", [(12, 32), (4, 16)])
def test_packed_attention_kernel(shape: tuple[int, int]) -> None:
    import tvm
    from goinfer.compiler.kernels import attention
    from goinfer.compiler.tvm import targets

    h, d = shape
    f = tvm.compile(
        tvm.IRModule({"main": attention.packed(h, d, d**-0.5).with_attr("global_symbol", "main")}),
        target=targets.make_target(targets.host_target(2)),
    )["main"]
    rng = np.random.default_rng(0)
    lengths = [5, 17, 1, 40, 16, 33]
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((off[-1], h, d)).astype(np.float32) for _ in range(3))
    out, lse = tvm.runtime.tensor(np.zeros_like(q)), tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    f(*(tvm.runtime.tensor(a) for a in (q, k, v, off)), out, lse)
    for a, z in itertools.pairwise(off):  # each input attends to itself only
        s = np.einsum("thd,jhd->htj", q[a:z], k[a:z]).astype(np.float64) * d**-0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("htj,jhd->thd", p / p.sum(-1, keepdims=True), v[a:z])
        np.testing.assert_allclose(out.numpy()[a:z], want, atol=3e-6)
