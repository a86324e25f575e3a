"""Our GGUF tokenizer: round trips and special tokens on the tiny files, llama.cpp's ids on real models.

The real-model goldens come from ``tests/goldens/record_tokenize.py`` (llama.cpp's ``llama-tokenize``,
no BOS, special tokens parsed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from goinfer.compiler.sources.gguf_file import load_gguf
from tiny_gguf import tiny_vocab, write_tiny_gguf
from tokenizers import Tokenizer

# `bench` is not installed: import it from the repo, wherever pytest was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.llama_cpp import find_llama_binary, llama_env

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
FLAGS = ("--ids", "--no-bos", "--no-escape", "--log-disable")  # as record_tokenize.py
FAMILIES = ("llama", "qwen2", "gemma3")
REAL_FILES = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf",
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
TEXTS = (
    "",
    "The quick brown fox jumps over the lazy dog.",
    "  two  spaces,\ttabs\t\tand\nnew\n\nlines\r\n",
    "def add(a, b):\n    return a + b  # 123 456\n",
    "unicode café, emoji 🙂🚀, CJK 世界, Привет",
    "We're here, they've gone, I'll stay.",
)


@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tiny_tok")
    return {
        f: Tokenizer.from_str(load_gguf(write_tiny_gguf(root / f"{f}.gguf", f)).tokenizer_json)
        for f in FAMILIES
    }


def _id(family: str, token: str) -> int:
    return tiny_vocab(family)[0].index(token)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tiny_tokenizers: dict[str, Tokenizer], family: str, text: str) -> None:
    tok = tiny_tokenizers[family]
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < tok.get_vocab_size() for i in ids)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chatml_specials(tiny_tokenizers: dict[str, Tokenizer], family: str) -> None:
    tok = tiny_tokenizers[family]
    start, end = _id(family, "<|im_start|>"), _id(family, "<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == start and ids[-1] == end and ids.count(start) == ids.count(end) == 1
    # Control tokens are special (dropped on request); the text between them is not.
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_user_defined_token(tiny_tokenizers: dict[str, Tokenizer]) -> None:
    tok = tiny_tokenizers["qwen2"]
    call = _id("qwen2", "<tool_call>")
    ids = tok.encode("x<tool_call>y").ids
    assert call in ids and tok.decode(ids, skip_special_tokens=True) == "x<tool_call>y"


def test_sentencepiece_pieces(tiny_tokenizers: dict[str, Tokenizer]) -> None:
    tok = tiny_tokenizers["gemma3"]
    ids = tok.encode("<start_of_turn>user\n\nThe  dog<end_of_turn>").ids
    assert ids[0] == _id("gemma3", "<start_of_turn>") and ids[-1] == _id("gemma3", "<end_of_turn>")
    assert _id("gemma3", "\n\n") in ids and _id("gemma3", "  ") in ids  # user-defined whitespace pieces
    # No dummy prefix (add_space_prefix is false) and no BOS: the runtime adds BOS itself.
    assert tok.encode("The").ids[0] != _id("gemma3", "<bos>")
    assert tok.id_to_token(tok.encode("The").ids[0])[0] != "▁"
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert [tok.id_to_token(i) for i in tok.encode("🙂").ids] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


@pytest.mark.skipif(find_llama_binary("llama-tokenize") is None, reason="llama.cpp tools are not built")
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_matches_llama_cpp(tiny_tokenizers: dict[str, Tokenizer], tmp_path: Path, family: str) -> None:
    binary = find_llama_binary("llama-tokenize")
    assert binary is not None
    model = write_tiny_gguf(tmp_path / "m.gguf", family)
    chat = "<start_of_turn>user\n" if family == "gemma3" else "<|im_start|>user\n"
    for i, text in enumerate((*TEXTS[1:], chat + TEXTS[1])):
        case = tmp_path / f"case{i}.txt"
        case.write_bytes(text.encode())
        cmd = [str(binary), "-m", str(model), "-f", str(case), *FLAGS]
        out = subprocess.run(cmd, env=llama_env(binary), capture_output=True, text=True, check=True)
        expected = json.loads(out.stdout.strip().splitlines()[-1])
        assert tiny_tokenizers[family].encode(text).ids == expected, text


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_FILES))
def test_real_model_matches_llama_cpp(real_gguf: Callable[[str], Path], name: str) -> None:
    golden = json.loads((GOLDENS / f"tokenize_{name}.json").read_text(encoding="utf-8"))
    tok = Tokenizer.from_str(load_gguf(real_gguf(name)).tokenizer_json)
    mismatches = [c["text"] for c in golden["cases"] if tok.encode(c["text"]).ids != c["ids"]]
    assert not mismatches, f"{len(mismatches)} of {len(golden['cases'])} differ from llama.cpp: {mismatches}"
    for case in golden["cases"]:
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
