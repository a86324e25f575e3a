"""Split GGUFs (llama.cpp's gguf-split: ``name-00001-of-0000N.gguf`` ...): read as one model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from goinfer.artifacts import giw
from goinfer.cli.main import main
from goinfer.compiler.sources import SourceError, load_checkpoint
from goinfer.compiler.sources.gguf_file import model_stem, shard_paths
from tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("split")
    return write_tiny_gguf(folder / "tiny-qwen2.gguf", "qwen2", split_max_tensors=12)


def test_the_shards_read_as_the_one_file_they_were_cut_from(split, tiny_gguf) -> None:
    shards = shard_paths(split)
    assert [p.name for p in shards] == [f"tiny-qwen2-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    whole, cut = load_checkpoint(tiny_gguf("qwen2")), load_checkpoint(split)
    assert cut.spec == whole.spec and cut.tokens == whole.tokens
    assert cut.tokenizer_json == whole.tokenizer_json and cut.chat_template == whole.chat_template
    assert list(cut.tensors) == list(whole.tensors)
    for name, t in whole.tensors.items():
        assert np.array_equal(cut.tensors[name].load(), t.load()), name
    # any shard names the model; its digest covers every shard's bytes, in order
    assert load_checkpoint(shards[2]).sha256 == cut.sha256 != whole.sha256
    assert model_stem(shards[1]) == "tiny-qwen2" and model_stem("a/b.gguf") == "b"


def test_a_missing_shard_is_refused(split, tmp_path: Path) -> None:
    for p in shard_paths(split)[:2]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(SourceError, match=r"missing shard tiny-qwen2-00003-of-00003\.gguf"):
        load_checkpoint(tmp_path / "tiny-qwen2-00001-of-00003.gguf")
    result = CliRunner().invoke(main, ["build", str(tmp_path / "tiny-qwen2-00002-of-00003.gguf")])
    assert result.exit_code == 2 and "missing shard" in result.stderr
    assert not list(tmp_path.glob("*.giw"))


def test_a_split_builds_and_is_named_without_its_shard_number(split, tiny_bundle, tmp_path: Path) -> None:
    out = tmp_path / "split.giw"
    result = CliRunner().invoke(
        main, ["build", str(split), "--quant", "f32", "--kv-dtype", "f32", "-o", str(out)]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    with giw.open_bundle(out) as cut, giw.open_bundle(tiny_bundle("qwen2")) as whole:
        assert cut.manifest["source"]["ref"] == split.name
        for name in whole.tensor_names():
            assert np.array_equal(cut.tensor(name), whole.tensor(name)), name
