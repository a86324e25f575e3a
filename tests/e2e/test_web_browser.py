"""The web page in a real browser: Playwright for Python driving the Chromium Debian packages,
against `goinfer serve` run as a user runs it (the real Qwen2.5-Coder-0.5B and a tiny model, an API
key, --allow-admin) and the local stand-in for the Hugging Face Hub.

One walk through the page, a screenshot at each step (the folder is printed):
the key asked for, a reply streaming in and its stats, a code block copied, a reply stopped
mid-stream (and the server's sequence freed), regenerate giving the same greedy reply, errors shown
in the page (a prompt over the window, a halted server), switching models, the Models tab, a pull
planned (no byte moved), pulled and built with its progress reaching "built", loaded, chatted with,
and the page reloaded with its conversations kept.

Run alone: python -m pytest -q tests/e2e/test_web_browser.py -s
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from goinfer.artifacts import cache
from hub_server import HubServer
from serve_process import serving

pytestmark = pytest.mark.slow

KEY = "web-page-key"
PULLED = "hf:o/tiny-GGUF:F32"


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium (ci/setup.sh installs it with apt-get), or $GOINFER_CHROMIUM; asked for
    first, so a machine without one skips before any model is built."""
    for candidate in (os.environ.get("GOINFER_CHROMIUM"), "chromium", "chromium-browser"):
        path = candidate and shutil.which(candidate)
        if path:
            return path
    pytest.skip(
        "no Chromium on this machine: ci/setup.sh installs Debian's (apt-get install chromium) where it "
        "runs as root or with passwordless sudo; or set GOINFER_CHROMIUM to a Chromium binary"
    )


def call(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def bundles(real_bundle, tiny_bundle) -> tuple[Path, Path]:
    """The served models, fetched and built in the user's cache (before `env` points it elsewhere)."""
    return real_bundle("qwen2.5-coder-0.5b"), tiny_bundle("qwen2")


@pytest.fixture
def env(bundles, tiny_gguf, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A cache of the test's own (its pulls and bundles), sharing the user's content-keyed caches
    (compiled modules, extracted libraries, verified markers), and the Hub stand-in."""
    root = tmp_path / "cache"
    root.mkdir()
    for name in ("modules", "libs", "verified"):
        shared = cache.folder(name)  # type: ignore[arg-type]
        shared.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("GOINFER_CACHE", str(root))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    hub = HubServer({"o/tiny-GGUF": {"tiny-F32.gguf": tiny_gguf("qwen2").read_bytes()}}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    yield hub
    hub.stop()


@pytest.fixture
def shots(capsys) -> Path:
    """$GOINFER_WEB_SHOTS, or goinfer-web-shots in the temp folder: emptied, then one PNG a step
    (outside pytest's own temp folders, which later runs on a shared machine rotate away)."""
    folder = Path(os.environ.get("GOINFER_WEB_SHOTS") or Path(tempfile.gettempdir()) / "goinfer-web-shots")
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    with capsys.disabled():
        print(f"\nweb page screenshots: {folder}")
    return folder


def test_the_page_in_a_browser(chromium: str, bundles, env: HubServer, shots: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    coder, tiny = bundles
    extra = ("--model", f"tiny={tiny}", "--allow-admin")
    with serving("coder", coder, KEY, *extra, log=tmp_path / "serve.log") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        n = iter(range(1, 100))

        def shot(name: str) -> None:
            page.screenshot(path=str(shots / f"{next(n):02d}-{name}.png"), full_page=True)

        def last_reply():
            return page.locator(".message.assistant").last

        def send(text: str) -> None:
            page.fill("#prompt", text)
            page.press("#prompt", "Enter")

        def finished() -> None:
            expect(page.locator("#send")).to_be_visible(timeout=120_000)

        def settings(temperature: str, max_tokens: str) -> None:
            page.eval_on_selector(
                "#temperature",
                "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }",
                temperature,
            )
            page.fill("#max-tokens", max_tokens)

        # 1. The page loads without a key; the API calls it makes are refused until it is given.
        page.goto(url + "/")
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", KEY)
        shot("key")
        page.click("#key-save")
        expect(page.locator("#model-picker option")).to_have_count(2)
        page.select_option("#model-picker", "coder")
        settings("0", "64")

        # 2. A reply streams in (seen before it ends), rendered as Markdown with a copyable code block.
        send("Write a Python function that adds two numbers.")
        expect(page.locator("#stop")).to_be_visible()
        expect(last_reply().locator(".body")).not_to_have_text("", timeout=60_000)
        assert page.locator("#stop").is_visible(), "the reply was seen while it streamed"
        shot("streaming")
        finished()
        meta = last_reply().locator(".meta").inner_text()
        assert re.search(r"coder · \d+ tokens · [\d.]+ tok/s · \d+ of \d+ prompt tokens cached", meta), meta
        code = last_reply().locator(".code pre").first
        expect(code).to_contain_text("def ")
        last_reply().locator(".code .copy").first.click()
        expect(last_reply().locator(".code .copy").first).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()").strip() == code.inner_text().strip()
        shot("reply")

        # 3. Stop mid-stream: the reply keeps what came, and the server frees the sequence.
        settings("0", "400")
        send("Write a long story about a lighthouse keeper and a storm.")
        expect(last_reply().locator(".body")).to_contain_text(re.compile(r"\w+ \w+ \w+"), timeout=60_000)
        page.click("#stop")
        finished()
        expect(last_reply().locator(".meta")).to_contain_text("stopped after")
        kept = last_reply().locator(".body").inner_text()
        assert kept.strip()
        shot("stopped")
        for _ in range(100):  # the server sees the client go at its next token or keep-alive poll
            model = call(url, "/health")["models"]["coder"]
            if model["running_or_queued"] == 0 and model.get("sessions_running", 0) == 0:
                break
            time.sleep(0.1)
        assert model["running_or_queued"] == 0 and model.get("sessions_running", 0) == 0, model

        # 4. Switch models; regenerate gives the same greedy reply; edit-and-resend replaces the turn.
        page.click("#new-chat")
        page.select_option("#model-picker", "tiny")
        settings("0", "24")
        send("Hello there")
        finished()
        first = last_reply().locator(".body").inner_text()
        expect(last_reply().locator(".meta")).to_contain_text("tiny ·")
        page.get_by_role("button", name="Regenerate").click()
        finished()
        assert last_reply().locator(".body").inner_text() == first
        page.get_by_role("button", name="Edit").click()
        page.fill(".message.user textarea.edit", "Hello again")
        page.locator(".message.user").get_by_role("button", name="Send").click()
        finished()
        expect(page.locator(".message.user .body")).to_have_text(["Hello again"])
        expect(page.locator(".message.assistant")).to_have_count(1)
        shot("tiny-model")

        # 5. Structured output: a pasted JSON schema constrains the reply (even a random tiny model's).
        color = {"color": {"enum": ["red", "green"]}}
        schema = {"type": "object", "properties": color, "required": ["color"]}
        page.check("#schema-on")
        page.fill("#schema", json.dumps(schema))
        settings("1", "64")
        send("Pick a color.")
        finished()
        assert json.loads(last_reply().locator(".body").inner_text())["color"] in ("red", "green")
        shot("structured")
        page.uncheck("#schema-on")

        # 6. Errors are messages in the page: a prompt over the window, a halted server.
        send("word " * 600)  # the tiny model's window is 256 tokens
        finished()
        expect(page.locator(".message.error").last).to_contain_text("context window")
        call(url, "/admin/halt", {"reason": "the browser test"})
        send("Anyone there?")
        finished()
        expect(page.locator(".message.error").last).to_contain_text("halted")
        call(url, "/admin/resume", {})
        shot("errors")

        # 7. The Models tab: what is loaded, then a pull planned before any byte moves.
        page.click("#tab-models")
        expect(page.locator("#loaded-table tr[data-model='coder']")).to_contain_text("llvm")
        expect(page.locator("#loaded-table tr[data-model='tiny']")).to_contain_text("tokens")
        expect(page.locator("#admin-notice")).to_be_hidden()
        shot("models")
        page.fill("#pull-ref", PULLED)
        page.select_option("#pull-quant", "gguf")
        page.click("#plan-button")
        size = len(env.repos["o/tiny-GGUF"].files["tiny-F32.gguf"])
        expect(page.locator("#plan-files")).to_contain_text("tiny-F32.gguf")
        expect(page.locator("#plan")).to_contain_text(f"{size / 1e3:.1f} kB")
        assert env.file_requests() == [], "the plan moved no file"
        shot("plan")

        # 8. Pull + Build, its progress streaming until it reaches "built"; then Load it.
        page.click("#pull-button")
        expect(page.locator("#pull-stages li[data-stage='built']")).to_have_class("done", timeout=180_000)
        log = page.locator("#pull-log").inner_text()
        assert "plan at commit" in log and "[1/6]" in log and "built" in log, log
        expect(page.locator("#load-name")).to_have_value("tiny-F32")
        shot("built")
        page.click("#load-button")
        expect(page.locator("#loaded-table tr[data-model='tiny-F32']")).to_be_visible(timeout=60_000)
        page.click("#refresh-disk")
        expect(page.locator(f"#disk-table tr[data-kind='hub'][data-name='{PULLED}']")).to_contain_text(
            "complete"
        )
        shot("loaded")

        # 9. Chat with the model just pulled.
        page.click("#tab-chat")
        page.click("#new-chat")
        page.select_option("#model-picker", "tiny-F32")
        send("Hi, new model")
        finished()
        expect(last_reply().locator(".meta")).to_contain_text("tiny-F32 ·")
        shot("pulled-model-chat")

        # 10. Reload: the conversations are kept (localStorage), the key too (this tab's session).
        titles = page.locator("#conversation-list .title").all_inner_texts()
        page.reload()
        expect(page.locator("#conversation-list .title")).to_have_text(titles)
        expect(page.locator(".message.user .body")).to_have_text(["Hi, new model"])
        page.get_by_role("button", name=titles[-1], exact=True).click()
        expect(page.locator(".message.user").first).to_contain_text("Write a Python function")
        expect(page.locator(".message.assistant .code").first).to_be_visible()
        page.click("#theme-button")
        shot("reloaded-dark")

        # 11. Unload the pulled model from the Models tab: it is gone from the server and the picker.
        page.click("#tab-models")
        page.once("dialog", lambda d: d.accept())  # "Unload tiny-F32?"
        page.locator("#loaded-table tr[data-model='tiny-F32']").get_by_role("button", name="Unload").click()
        expect(page.locator("#loaded-table tr[data-model='tiny-F32']")).to_have_count(0)
        assert "tiny-F32" not in {m["id"] for m in call(url, "/v1/models")["data"]}
        expect(page.locator("#model-picker option")).to_have_count(2)

        # 12. A reply cannot inject markup: the renderer builds text nodes, never HTML.
        hostile = "<img src=x onerror=alert(1)> **bold** [x](javascript:alert(1)) <script>alert(2)</script>"
        rendered = page.evaluate(
            """async (text) => {
                const { render } = await import('/web/assets/markdown.js');
                const div = document.createElement('div');
                div.append(render(text, () => {}));
                return [div.querySelectorAll('img, script, a').length, div.querySelectorAll('strong').length,
                        div.textContent];
            }""",
            hostile,
        )
        assert rendered[0] == 0 and rendered[1] == 1 and "<img src=x" in rendered[2], rendered
        assert problems == [], problems
        browser.close()
