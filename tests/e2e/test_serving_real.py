"""The serving engine on the real default model, through `goinfer serve` and the openai SDK:
prompt-prefix reuse across the turns of a conversation, concurrent clients, sessions on disk."""

from __future__ import annotations

import threading

import pytest
from serve_process import serving

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

KEY, NAME = "test-key", "qwen"
GREEDY = {"temperature": 0, "max_tokens": 24}
USER_TURNS = ("What does the function `merge` do?", "Write one unit test for it.", "Now one for empty lists.")


def system_prompt(words: int = 2200) -> str:
    """A long, fixed system prompt (an agent harness's), about 3,000 tokens."""
    rules = [
        f"Rule {i}: when the user asks about module m{i}, answer in terms of its function f{i}, "
        f"which takes a list of {i % 7 + 2} integers and returns their running total."
        for i in range(words // 24)
    ]
    return "You are a careful coding assistant.\n" + "\n".join(rules)


def conversation(client: openai.OpenAI, system: str) -> list[tuple[str, int, int]]:
    """Three turns; (reply, prompt_tokens, cached_tokens) each."""
    messages, out = [{"role": "system", "content": system}], []
    for turn in USER_TURNS:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
        text = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        details = r.usage.prompt_tokens_details
        out.append((text, r.usage.prompt_tokens, details.cached_tokens if details else 0))
    return out


@pytest.fixture(scope="module")
def bundle(real_bundle):
    return real_bundle("qwen2.5-coder-0.5b", "gguf")


def test_later_turns_reuse_the_system_prompt_and_reply_as_cold(bundle, tmp_path) -> None:
    system = system_prompt()
    with serving(NAME, bundle, KEY, "--kv-sessions", "0") as url:  # no reuse: every turn cold
        cold = conversation(
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600), system
        )
    with serving(NAME, bundle, KEY, "--session-dir", str(tmp_path)) as url:
        warm = conversation(
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600), system
        )
    assert cold[0][1] >= 3000 and all(c[2] == 0 for c in cold)
    assert warm[0][2] == 0
    for (_t, prompt, cached), prev in zip(warm[1:], warm, strict=False):
        # Any shared token (exact reuse at token granularity): the previous turn's whole prompt,
        # and its reply as far as the template renders it back the same
        assert prev[1] <= cached < prompt
    assert [t for t, _p, _c in warm] == [t for t, _p, _c in cold]  # bit-exact reuse: the same replies

    # A restart with the same --session-dir: the conversation continues warm at once.
    with serving(NAME, bundle, KEY, "--session-dir", str(tmp_path)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
        messages = [{"role": "system", "content": system}]
        for (text, _p, _c), turn in zip(warm, USER_TURNS, strict=True):
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": text}]
        messages.append({"role": "user", "content": "Thanks."})
        r = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached >= warm[-1][1]  # the last conversation's prompt, at least


def test_four_clients_at_once_each_get_their_own_reply(bundle) -> None:
    prompts = [f"Write a haiku about the number {n}." for n in (3, 17, 42, 99)]
    with serving(NAME, bundle, KEY, "--kv-sessions", "0") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)

        def ask(p: str) -> str:
            r = client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": p}], **GREEDY
            )
            return r.choices[0].message.content or ""

        alone = [ask(p) for p in prompts]
        together: dict[int, str] = {}
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, ask(prompts[i]))) for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert [together[i] for i in range(4)] == alone
