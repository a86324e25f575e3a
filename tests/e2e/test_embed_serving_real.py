"""One `goinfer serve` process with the default decoder and all-MiniLM-L6-v2 beside it, driven by
the openai SDK: 4 chat clients and 4 embedding clients at once, each getting what it gets alone
(the chat replies token for token, the vectors bit for bit), and each route refusing the other
kind of model by name."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
from serve_process import serving

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

KEY, CHAT, EMBED = "test-key", "qwen", "minilm"
GREEDY = {"temperature": 0, "max_tokens": 24}
DOCS = [
    ["def f(xs): return sorted(xs)[3]", "A cat sat on the mat.", "Retrieval-augmented generation"],
    ["How do I reverse a list in Python?", "SELECT * FROM users WHERE id = 7;", "naïve café — déjà vu"],
    ["The mitochondria is the powerhouse of the cell. " * 12, "x", "🙂 emoji and\ttabs\nand lines"],
    [f"document {n}: " + "tokens " * n for n in (1, 40, 200)],
]


@pytest.fixture(scope="module")
def bundles(real_bundle):
    return real_bundle("qwen2.5-coder-0.5b", "gguf"), real_bundle("all-minilm-l6-v2", "q8_0")


def _vectors(reply, base64_encoded: bool) -> np.ndarray:
    if base64_encoded:  # the SDK hands base64 back as the string when asked for it explicitly
        return np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in reply.data])
    return np.array([d.embedding for d in reply.data], np.float32)


def test_a_decoder_and_an_encoder_serve_eight_clients_at_once(bundles) -> None:
    from goinfer.runtime.encoder import Encoder

    qwen, minilm = bundles
    want_vectors = Encoder.load(minilm).embed([t for batch in DOCS for t in batch])
    prompts = [f"Write a haiku about the number {n}." for n in (3, 17, 42, 99)]
    with serving(CHAT, qwen, KEY, "--kv-sessions", "0", "--embed-model", f"{EMBED}={minilm}") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)

        def chat(p: str) -> str:
            r = client.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": p}], **GREEDY
            )
            return r.choices[0].message.content or ""

        def embed(i: int) -> np.ndarray:
            fmt = "base64" if i % 2 else "float"
            reply = client.embeddings.create(model=EMBED, input=DOCS[i], encoding_format=fmt)
            assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
            return _vectors(reply, fmt == "base64")

        alone = [chat(p) for p in prompts]
        results: dict[tuple[str, int], object] = {}
        jobs = [("chat", i, lambda i=i: chat(prompts[i])) for i in range(4)]
        jobs += [("embed", i, lambda i=i: embed(i)) for i in range(4)]
        threads = [
            threading.Thread(target=lambda k=k, i=i, f=f: results.__setitem__((k, i), f()))
            for k, i, f in jobs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)

        models = {m.id: m for m in client.models.list().data}
        with pytest.raises(openai.BadRequestError, match=EMBED):
            client.embeddings.create(model=CHAT, input="a decoder cannot embed here")
        with pytest.raises(openai.BadRequestError, match=CHAT):
            client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
        short = client.embeddings.create(model=EMBED, input=DOCS[0], dimensions=128)

    assert [results[("chat", i)] for i in range(4)] == alone
    got = np.concatenate([results[("embed", i)] for i in range(4)])
    np.testing.assert_array_equal(got, want_vectors)  # batched with strangers: the bits it gets alone
    assert models[EMBED].kind == "embedding" and models[EMBED].dimensions == 384
    assert models[CHAT].kind == "chat"
    cut = _vectors(short, False)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    head = want_vectors[:3, :128]
    np.testing.assert_allclose(cut, head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-6)
