"""Deterministic inputs for the embedding benchmark and reference test (no network, no randomness
that a run could change): varied English and code, and 50 sentences of varied shape.

`batch` and `query` take a tokenizer (text -> ids with [CLS] and [SEP]) so the lengths land where
the bench says: the throughput case is ~128 tokens an input, the latency case a 16-token query.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

Tokenize = Callable[[str], list[int]]

# Pieces the throughput inputs are drawn from: prose on unrelated subjects, and code of a few
# languages, so the batch's tokens are not one repeated pattern.
_PROSE = (
    "The river had risen overnight, and by morning the lower fields were a single sheet of brown water.",
    "Compilers lower a program through several representations before any machine code appears.",
    "She kept the letters in a tin box under the stairs, tied with the string from a bakery parcel.",
    "A hash map trades memory for speed: lookups are constant time on average, not in the worst case.",
    "The committee postponed its decision until the auditors had finished reviewing the accounts.",
    "Migrating birds navigate by the stars, the sun, and the faint pull of the earth's magnetic field.",
    "Retry the request with exponential backoff, but give up after five attempts and log the failure.",
    "In the old town the streets are too narrow for cars, so deliveries arrive by handcart at dawn.",
    "Photosynthesis converts light into chemical energy, storing it in the bonds of sugar molecules.",
    "The quarterly report shows revenue up eight percent while operating costs stayed nearly flat.",
    "He tuned the violin twice before the concert, since the hall was colder than the rehearsal room.",
    "Garbage collectors pause the program, or run beside it, to reclaim memory nothing can reach.",
    "Volcanic soil is rich in minerals, which is why vineyards climb the slopes of dormant craters.",
    "Please confirm the delivery address and the preferred time window before Thursday afternoon.",
    "The proof proceeds by induction on the length of the derivation, with two cases at each step.",
    "Tidal forces slowly lengthen the day, as the moon drifts a few centimetres farther every year.",
)
_CODE = (
    "def load_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "for (int i = 0; i < n; ++i) { total += weights[i] * inputs[i]; }",
    "SELECT name, COUNT(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC;",
    "const users = await db.query('users').where({ active: true }).limit(50);",
    "fn parse(input: &str) -> Result<Config, Error> { toml::from_str(input).map_err(Error::from) }",
    "git rebase --onto main feature~3 feature && git push --force-with-lease origin feature",
    'if err != nil {\n\treturn fmt.Errorf("open %s: %w", path, err)\n}',
    "class Cache:\n    def __init__(self, size=128):\n        self.items = OrderedDict()\n",
)

QUERY_TEXT = "how do I retry a failed http request with exponential backoff in python"


def _fit(text: str, tokenize: Tokenize, tokens: int) -> str:
    """The longest run of `text`'s words from its start whose tokens (specials included) are at
    most `tokens`. A word keeps the whitespace after it, so code keeps its newlines and indents."""
    words = re.findall(r"\S+\s*", text)
    lo, hi = 1, len(words)
    while lo < hi:  # binary search on the word count: tokenizing is the cost here
        mid = (lo + hi + 1) // 2
        if len(tokenize("".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    out = "".join(words[:lo])
    # Then the next word a character at a time: one code "word" can be 20 tokens.
    for ch in words[lo] if lo < len(words) else "":
        if len(tokenize(out + ch)) > tokens:
            break
        out += ch
    return out.rstrip()


def batch(tokenize: Tokenize, n: int = 64, tokens: int = 128) -> list[str]:
    """`n` distinct inputs of close to `tokens` tokens each (at most `tokens`), prose mixed with code."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        pieces = [f"Note {i}:"]
        while len(tokenize(" ".join(pieces))) < tokens + 8:
            pool = _CODE if rng.random() < 0.3 else _PROSE
            pieces.append(rng.choice(pool))
        out.append(_fit(" ".join(pieces), tokenize, tokens))
    return out


def query(tokenize: Tokenize, tokens: int = 16) -> str:
    return _fit(QUERY_TEXT, tokenize, tokens)


# The reference test's sentences: short and long, punctuation, numbers, unicode (accents, CJK,
# emoji, right-to-left), code and markup, odd whitespace. Three run past 128 tokens (the window
# tokenizer.json itself declares) and all stay under sentence-transformers' 256.
SENTENCES: tuple[str, ...] = (
    "Hello.",
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "What time does the last train to Edinburgh leave on Sundays?",
    "I can't believe it's already December!!!",
    "Résumé, naïve, façade, coöperate, jalapeño — all loanwords.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Я люблю программировать на Python.",
    "مرحبا بالعالم",
    "The temperature dropped to −40 °C, where Celsius and Fahrenheit agree.",
    "Prices rose 3.5% in Q3 2024, vs. 2.1% a year earlier ($1,299 → $1,345).",
    "🚀 Launch day! 🎉 Thanks to everyone who helped 🙏",
    "e = mc², ∑ᵢ xᵢ = 1, and ∀x ∈ ℝ: x² ≥ 0.",
    "def add(a, b):\n    return a + b",
    "for i in range(10): print(i ** 2)",
    "SELECT id, email FROM users WHERE created_at > NOW() - INTERVAL '7 days';",
    '<div class="card"><h2>Title</h2><p>Body text &amp; more.</p></div>',
    '{"name": "goinfer", "version": "0.1.0", "tags": ["llm", "tvm"]}',
    "git commit -m 'fix: handle empty input' && git push origin main",
    'int main(void) { printf("%d\\n", 42); return 0; }',
    "   leading and trailing spaces   ",
    "tabs\tbetween\twords and\nnew\nlines",
    "ALL CAPS SENTENCE ABOUT AN URGENT MATTER",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "https://example.com/path?query=embedding&lang=en#section-2",
    "user@example.org wrote: see RFC 5322 §3.4.1 for the address syntax.",
    "How do I reverse a linked list in place without extra memory?",
    "The mitochondria is the powerhouse of the cell.",
    "Sentence embeddings map text to vectors so that similar meanings land close together.",
    "No.",
    "Why?",
    "1 2 3 4 5 6 7 8 9 10",
    "The meeting was moved from Tuesday at 3 p.m. to Wednesday at 10 a.m. (room 4B).",
    "She said, \"It's not what you said; it's how you said it.\"",
    "Rust's borrow checker rejects two mutable references to the same value at once.",
    "Refund request: order #88213 arrived damaged, please advise.",
    "I love this product! Five stars, would buy again.",
    "This is the worst customer service I have ever experienced.",
    "Kubernetes reschedules pods when a node fails its health checks.",
    "lambda x: x if x > 0 else -x",
    "Ünïcödé wïth dïäcrïtïcs everywhere, just to be sure.",
    "中文、日本語、한국어 mixed with English words in one line.",
    "The committee's report (pp. 12–15) notes three objections; see Appendix C.",
    "Is it possible to fine-tune a model on fewer than a hundred examples?",
    # Past 128 tokens: a long paragraph, a long code block and a long list.
    " ".join(_PROSE[:8]),
    "\n".join(_CODE),
    "Ingredients: "
    + ", ".join(
        f"{q} {u} of {w}"
        for q, u, w in zip(
            range(1, 25),
            ("cup", "tablespoons", "cloves", "grams", "pinches", "handfuls") * 4,
            ("flour", "sugar", "garlic", "butter", "salt", "basil", "rice", "lentils", "cream", "oats") * 2
            + ("mint", "dill", "honey", "yeast"),
            strict=True,
        )
    ),
    "Short again.",
    "The end.",
)
