"""Record llama.cpp's tokenization of tricky strings as goldens for our GGUF tokenizer.

For each zoo model and each case below, write the text to a file and run

    llama-tokenize -m <model.gguf> -f <case.txt> --ids --no-bos --no-escape --log-disable

``-f`` reads the bytes verbatim, ``--no-escape`` keeps backslashes literal, special tokens are parsed
(llama-tokenize's default), and ``--no-bos`` leaves BOS to our runtime. The printed list is the
golden. Writes ``tests/goldens/tokenize_<model>.json`` as {"command", "llama_cpp", "cases":
[{"text", "ids"}]}. Needs the llama.cpp tools (``python -m bench.llama_cpp build``); without
``llama-tokenize`` it says so and exits 0. Run from the repo root:

    python tests/goldens/record_tokenize.py [MODEL ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # for `bench`, which is not an installed package

from goinfer.compiler.sources import zoo  # noqa: E402

from bench.llama_cpp import find_llama_binary, llama_env  # noqa: E402

MODELS = ("qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m")
FLAGS = ("--ids", "--no-bos", "--no-escape", "--log-disable")

CASES = (
    "",
    "a",
    " ",
    "\n",
    "Hello world",
    "hello  world",
    "   leading spaces",
    "trailing spaces   ",
    "spaces run:" + " " * 40 + "end",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\rCR",
    "  \n  \n\n    \t\n",
    "unicode: café naïve façade Ångström Straße",
    "combining: e\u0301 a\u0308 n\u0303",
    "emoji: 🙂🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "🙂",
    "CJK: 世界你好，这是一个测试。日本語のテキストです。한국어 텍스트",
    "mixed scripts: Привет мир, Γειά σου, مرحبا, שלום, हिन्दी, ไทย",
    "Ｆｕｌｌｗｉｄｔｈ ｆｏｒｍｓ and ｶﾀｶﾅ",
    "NBSP\u00a0ideographic\u3000thin\u2009narrow\u202fspaces",
    "zero width\u200bspace, joiner\u200d and BOM\ufeff",
    "control: bell\x07 escape\x1b[0m del\x7f",
    "math: ∑∫√∞ ≤ ≥ ≠ ± ½ ²",
    "numbers: 1234567890 3.14159 1,000,000 0x1F 2024-01-31",
    "digits next to letters: abc123def 4ever x86_64",
    "contractions: I'm, you're, they've, we'll, she'd, it's, DON'T, WE'RE",
    "'s 're 've leading apostrophes",
    "ALL CAPS AND MiXeD CaSe words",
    "punct: !!!??? ... --- ___ *** ### @@@ ~~~ ```",
    "long word: pneumonoultramicroscopicsilicovolcanoconiosis",
    "repeated: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "\tif (a && b) { return x->y[i] << 2; } // comment\n",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "URL: https://example.com/path/to?query=1&b=%20#frag",
    "html: <table><tr><td>x</td></tr></table> <b>bold</b> <h1>T</h1>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> and </s> and <unk> and <pad>",
    "before<|endoftext|>after",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "literal byte token <0x0A> and <0xFF>",
    "<|im_start|><|im_start|>  <|im_end|>",
    "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。",
    # Characters whose Unicode class trips regex pre-tokenizers: private use, unassigned, format,
    # odd line separators, number letters, titlecase, math alphanumerics, ligatures, NUL.
    "private\ue000!! unassigned a\u0378b! tag x\U000e0001y",
    "NEL\u0085line\u2028sep\u2029para",
    "١٢٣ Ⅻ ½ x² ǅ ǈ ǋ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 ﬁ \u00ad",
    "\u0300 leading combining, a\u0300\u0301\u0302 stacked",
    "\x00nul and 🏳️‍🌈 ❤️",
    "\r\n\r\n  \t  x a \n b   \n x  ",
    (
        "Tokenizers split text into pieces. In Python, `tokens = tok.encode(text)` returns ids; "
        "decoding them should give the text back, byte for byte.\n\n"
        "class Cache:\n    def __init__(self, size: int = 128) -> None:\n        self.size = size\n"
        "        self._data: dict[str, bytes] = {}\n\n"
        "Prices rose 3.5% to $1,234.56 on 2024-03-15 (see https://example.org/report?id=42)."
    ),
)


def tokenize(binary: Path, model: Path, text: str, workdir: Path) -> list[int]:
    case = workdir / "case.txt"
    case.write_bytes(text.encode("utf-8"))
    out = subprocess.run(
        [str(binary), "-m", str(model), "-f", str(case), *FLAGS],
        env=llama_env(binary),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def record(name: str, binary: Path) -> Path:
    model = zoo.fetch(name)
    version = (
        subprocess.run([str(binary), "--version"], env=llama_env(binary), capture_output=True, text=True)
        .stderr.strip()
        .splitlines()
    )
    with tempfile.TemporaryDirectory() as tmp:
        cases = [{"text": t, "ids": tokenize(binary, model, t, Path(tmp))} for t in CASES]
    golden = {
        "command": f"llama-tokenize -m {model.name} -f <case.txt> {' '.join(FLAGS)}",
        "llama_cpp": version[0] if version else "unknown",
        "cases": cases,
    }
    path = Path(__file__).parent / f"tokenize_{name}.json"
    path.write_text(_dumps(golden), encoding="utf-8")
    return path


def _dumps(golden: dict) -> str:
    # One case per line keeps the file readable and its diffs small.
    head = {k: v for k, v in golden.items() if k != "cases"}
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in golden["cases"])
    return json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ',\n "cases": [\n' + body + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    args = ap.parse_args(argv)
    binary = find_llama_binary("llama-tokenize")
    if binary is None:
        print("llama-tokenize not found (python -m bench.llama_cpp build); nothing recorded")
        return 0
    for name in args.models:
        print(f"{name}: {record(name, binary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
