"""The benchmark's arithmetic and argument checks (no model, no llama.cpp)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import run


def _row(**kw) -> run.Row:
    base = dict(
        model="m", quant="int4", ours_tg=30.0, peer_tg=20.0, ours_pp=50.0, peer_pp=100.0,
        ours_mb_per_token=300.0, peer_mb_per_token=450.0, bandwidth_gbs=10.0,
        rss_after_load_mb=400.0, bundle_mb=350.0, cold_first_token_s=0.4,
    )  # fmt: skip
    return run.Row(**{**base, **kw})


def test_ratios_and_roofline():
    r = _row()
    assert r.tg_ratio == pytest.approx(1.5) and r.pp_ratio == pytest.approx(0.5)
    # 300 MB/token at 30 tok/s = 9 GB/s of a 10 GB/s machine
    assert r.ours_roofline == pytest.approx(0.9)
    assert r.peer_roofline == pytest.approx(0.9)
    assert math.isnan(run.ratio(1.0, 0.0)) and math.isnan(run.roofline_fraction(1, 1, 0))
    # against the bandwidth over a buffer of the weights' size, where a cache holds part of them
    assert _row(bandwidth_at_size_gbs=18.0).ours_roofline_at_size == pytest.approx(0.5)
    assert math.isnan(r.ours_roofline_at_size)  # not measured


def test_median_and_table():
    assert run.median([3.0, 1.0, 2.0]) == 2.0 and math.isnan(run.median([]))
    text = run.table([_row(), _row(model="other", ours_tg=10.0)])
    lines = text.splitlines()
    assert len(lines) == 4 and "1.50x" in lines[2] and "0.50x" in lines[3] and "90%" in lines[2]
    assert "@size" in lines[0] and "45%" in run.table([_row(bandwidth_at_size_gbs=20.0)]).splitlines()[2]


def test_unknown_names_are_one_line_errors():
    assert run.parse_list("int4, int8int8", run.KNOWN_QUANTS, "quant") == ["int4", "int8int8"]
    with pytest.raises(SystemExit, match="unknown model nope"):
        run.parse_list("nope", run.MODELS, "model")
    with pytest.raises(SystemExit, match="unknown quant"):
        run.parse_list("", run.KNOWN_QUANTS, "quant")


class _ScriptedModel:
    """Logits that put probability p_right on the next token of `text` and spread the rest evenly;
    records what each forward pass was fed (one call a chunk, in order)."""

    add_bos, bos_id, vocab = True, 0, 10

    def __init__(self, text: list[int], p_right: float) -> None:
        self.text, self.p_right, self.fed = text, p_right, []

    def prefill_logits(self, ids: list[int]):
        start = len(self.fed) * len(ids)  # chunks come in order, one call each
        self.fed.append(list(ids))
        rest = (1 - self.p_right) / (self.vocab - 1)
        rows = np.full((len(ids), self.vocab), np.log(rest))
        for j in range(len(ids)):
            if start + j + 1 < len(self.text):
                rows[j, self.text[start + j + 1]] = np.log(self.p_right)
        yield rows


def test_perplexity_scores_second_halves_as_llama_perplexity_does():
    from bench import quality

    tokens = list(np.random.default_rng(0).integers(1, 10, 40))
    model = _ScriptedModel(tokens, p_right=0.5)
    lps = list(quality.scored_logprobs(model, tokens, ctx=8, chunks=3))
    # 3 chunks of 8, BOS first in each; positions 4..6 score the tokens at 5..7
    assert [f[0] for f in model.fed] == [0, 0, 0] and [f[1:] for f in model.fed] == [
        tokens[i * 8 + 1 : (i + 1) * 8] for i in range(3)
    ]
    assert [list(t) for _, t in lps] == [tokens[i * 8 + 5 : (i + 1) * 8] for i in range(3)]
    assert quality.perplexity(lps) == pytest.approx(2.0)  # every scored token at p = 0.5
    kl, top1 = quality.against(lps, lps)
    assert kl == pytest.approx(0.0, abs=1e-12) and top1 == 1.0
    worse = list(quality.scored_logprobs(_ScriptedModel(tokens, p_right=0.25), tokens, ctx=8, chunks=3))
    kl, top1 = quality.against(worse, lps)
    assert kl > 0.1 and top1 == 1.0 and quality.perplexity(worse) == pytest.approx(4.0)


def _qrow(quant: str, mb: float, ppl: float, model: str = "m", text: str = "code"):
    from bench import quality

    return quality.Row(model, quant, text, ppl, ppl, 0.0, 1.0, mb, 10.0)


def test_quality_per_byte_frontier():
    from bench import quality

    assert quality.QUANTS[0] == "gguf"  # the default build leads the report
    assert "qwen2.5-coder-1.5b" in run.MODELS and set(quality.DEFAULT_MODELS) <= set(run.MODELS)
    rows = [
        _qrow("f32", 2000.0, 10.0),
        _qrow("int4", 300.0, 11.5),
        _qrow("gguf", 330.0, 10.6),
        _qrow("int4mix", 350.0, 10.8),  # bigger and worse than gguf: off
        _qrow("int8int8", 600.0, 10.6),  # as good as gguf but bigger: off (a tie does not save it)
        _qrow("f32", 2000.0, 9.0, text="seed"),
        _qrow("int4", 300.0, 9.5, text="seed"),
        _qrow("bad", 100.0, float("nan"), text="seed"),  # a failed score: never on, pushes none off
        _qrow("int4", 300.0, 20.0, model="other"),  # alone in its group: on
    ]
    got = [(r.model, r.text, r.quant, ok) for r, ok in quality.frontier(rows)]
    assert got == [
        ("m", "code", "int4", True),
        ("m", "code", "gguf", True),
        ("m", "code", "int4mix", False),
        ("m", "code", "int8int8", False),
        ("m", "code", "f32", True),
        ("m", "seed", "bad", False),
        ("m", "seed", "int4", True),
        ("m", "seed", "f32", True),
        ("other", "code", "int4", True),
    ]
    lines = quality.frontier_table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and "MB/tok" in lines[0]
    assert lines[2].split() == ["m", "code", "int4", "300", "11.500", "*"]
    assert lines[4].split() == ["m", "code", "int4mix", "350", "10.800"]


# -- bench.serving: the streaming fold, the prompts and the arithmetic (no server, no model) ------------
def test_serving_folds_a_chat_stream_with_tool_calls_and_usage():
    from bench import serving

    def call(**fn):
        head = {"id": fn.pop("id")} if "id" in fn else {}
        return {"index": 0, **head, "function": fn}

    reply = serving._Reply(start=10.0)
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},  # the opening chunk: no output
        {"choices": [{"delta": {"content": "Let me look."}}]},
        {"choices": [{"delta": {"tool_calls": [call(id="c1", name="grep", arguments='{"pat')]}}]},
        {"choices": [{"delta": {"tool_calls": [call(arguments='tern": "x"}')]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 4000, "completion_tokens": 9,
                                  "prompt_tokens_details": {"cached_tokens": 3900}}},
    ]  # fmt: skip
    for i, c in enumerate(chunks):
        reply.add(c, 10.5 + i)
    s = reply.finish(20.0)
    assert s.ttft_s == pytest.approx(1.5) and s.deltas == 3 and s.latency_s == pytest.approx(10.0)
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens, s.tokens) == (4000, 9, 3900, 9)
    assert s.decode_tok_s == pytest.approx(2 / 2.0)  # 2 deltas after the first over 2 s
    made = s.message["tool_calls"][0]
    assert s.message["content"] == "Let me look." and made["id"] == "c1"
    assert made["function"] == {"name": "grep", "arguments": '{"pattern": "x"}'}
    msgs = serving.reply_messages(s.message)
    assert [m["role"] for m in msgs] == ["assistant", "tool"] and msgs[1]["tool_call_id"] == "c1"
    # llama-server's own count when usage has no details; none at all is None, not 0
    assert serving.cached_tokens({"prompt_tokens": 5}, {"cache_n": 4}) == 4
    assert serving.cached_tokens(None, None) is None
    with pytest.raises(SystemExit, match="error"):
        reply.add({"error": {"message": "boom"}}, 21.0)


def test_serving_streams_over_http():
    import http.server
    import json
    import threading

    from bench import serving

    class SSE(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] and body["stream_options"] == {"include_usage": True}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in ["a", "b", "c"]:
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode())
            self.wfile.write(
                b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
            )
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        streams = serving.together(3, lambda i: serving.stream(port, "/v1/completions", {"prompt": [i]}))
    finally:
        srv.shutdown()
    assert [(s.deltas, s.tokens, s.prompt_tokens, s.cached_tokens) for s in streams] == [(3, 3, 7, None)] * 3


def test_serving_prompts_are_fixed_and_sized():
    from bench import serving

    tools = serving.agent_tools()
    assert len(tools) == 20 and len({t["function"]["name"] for t in tools}) == 20
    for t in tools:
        params = t["function"]["parameters"]
        assert set(params["required"]) <= set(params["properties"])
    a, b = serving.agent_system_prompt(0), serving.agent_system_prompt(1)
    assert a == serving.agent_system_prompt(0) and a != b  # deterministic; each round a new prefix
    assert a.split("\n", 1)[1] == b.split("\n", 1)[1]  # differing only in the opening line
    assert len(a) + len(json.dumps(tools)) > 12_000  # ~4k tokens (3,949 with Qwen's template, measured)
    prompts = [serving.concurrency_prompt(i) for i in range(16)]
    assert len(set(prompts)) == 16
    ids = serving.depth_prompt(lambda text: [ord(c) for c in text], 5000)
    assert len(ids) == 5000 and ids == [ord(c) for c in serving.source_text(200)][:5000]


def test_serving_summaries_and_targets():
    from bench import serving

    assert serving.percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert serving.percentile([1.0, 2.0], 99) == pytest.approx(1.99) and math.isnan(
        serving.percentile([], 50)
    )

    def turn(t, ttft, cached):
        return {"turn": t, "ttft_s": ttft, "prompt_tokens": 4000 + t, "cached_tokens": cached}

    raw = {
        "goinfer": [[turn(1, 10.0, None), turn(2, 0.2, 3990)], [turn(1, 12.0, None), turn(2, 0.4, 3990)]],
        "llama-server": [[turn(1, 20.0, 3), turn(2, 0.5, 3973)], [turn(1, 20.0, 3), turn(2, 0.5, 3973)]],
    }
    rows = serving.agent_summary({"turns": 2, "raw": raw})
    assert rows[0]["ttft_ratio"] == pytest.approx(0.55) and rows[1]["ttft_ratio"] == pytest.approx(0.6)
    assert rows[1]["cached_tokens_ours"] == 3990 and rows[0]["cached_tokens_ours"] is None
    met, line = serving.agent_target(rows)
    assert met and "met (worst 0.60x, turn 2)" in line
    assert serving.agent_table(rows).splitlines()[2].split()[3] == "-"  # no cached count: "-", not 0

    def run(n, tok_s, lat):
        return {"clients": n, "tok_s": tok_s, "latency_s": lat, "completion_tokens": 128 * n}

    ours = [run(1, 30.0, [4.0]), run(4, 50.0, [5.0, 6.0, 7.0, 8.0])]
    peer = [run(1, 35.0, [3.6]), run(4, 40.0, [12.0] * 4)]
    res = {"clients": [1, 4], "raw": {"goinfer": ours, "llama-server": peer}}
    rows = serving.concurrency_summary(res)
    assert rows[1]["tok_s_ratio"] == pytest.approx(1.25) and rows[1]["p50_ours_s"] == pytest.approx(6.5)
    (scale, peer) = serving.concurrency_targets(rows)
    assert not scale[0] and "(1.67x)" in scale[1] and not peer[0] and "(1.25x)" in peer[1]
    assert len(serving.concurrency_table(rows).splitlines()) == 4

    depth = [{"depth": 1024, "ratio": 1.6}, {"depth": 16384, "ratio": 1.2}]
    met, line = serving.depth_target(depth)
    assert not met and "worst 1.20x at 16384" in line


def test_serving_arguments():
    from bench import serving

    a = serving.parse_args(["--bench", "depth", "--models", "qwen2.5-coder-0.5b", "--depths", "1024"])
    assert a.benches == ["depth"] and a.model_names == ["qwen2.5-coder-0.5b"] and a.depths == [1024]
    assert a.clients == [1, 2, 4, 8] and a.rounds == 1 and a.turns == 4
    with pytest.raises(SystemExit, match="unknown bench"):
        serving.parse_args(["--bench", "speed"])
    with pytest.raises(SystemExit, match="integers"):
        serving.parse_args(["--depths", "1k"])
