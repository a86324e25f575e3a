"""Thinking models for the tests: the templates, a tiny checkpoint whose vocabulary has `<think>`
and `</think>` as tokens of their own, and a scripted sampler that makes a random model write a
scripted reply.

- QWEN3_TEMPLATE is Qwen3-0.6B's own chat template (tests/fixtures/templates/qwen3.jinja): it thinks
  unless enable_thinking is false (then it writes an empty closed block), and replays
  reasoning_content for the turns after the last user query. OPEN_BLOCK_TEMPLATE is the other shape
  real checkpoints have (Qwen3.5's small models): it does not think unless told to, and when it
  does the prompt itself opens the block.
- `write_thinking_gguf` copies one of tiny_gguf's qwen2 files with the two delimiters appended to
  its vocabulary (user-defined tokens, as Qwen3's GGUFs have them; their embedding and output rows
  drawn like the rest) and a template of the test's choosing.
- `ScriptedSampler` replaces the runtime's sampler: it picks the next token of `SCRIPT` whatever
  the logits say, except where every token but one is masked out (a forced token, or a grammar's
  only choice), which it takes. A forced `</think>` skips the script past its own, so the
  "model" answers once its block was closed for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()  # Qwen/Qwen3-0.6B's, byte for byte

# Thinks only when asked to, and then the prompt opens the block (the model starts inside it).
OPEN_BLOCK_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- '<think>\\n' }}
    {%- else %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

DELIMITERS = ("<think>", "</think>")
USER_DEFINED = 4  # llama_token_type: how Qwen3's GGUFs store <think> and </think>

# One question and the scripted reply the thinking tests make the model write.
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT, ANSWER = "Two and two make four.", "It is 4."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


def write_thinking_gguf(src: str | Path, dst: str | Path, template: str, seed: int = 1) -> Path:
    """A copy of tiny_gguf's qwen2 file `src` with `<think>`/`</think>` appended to the vocabulary
    (and to token_embd/output, rows drawn like the rest) and `template` as its chat template."""
    reader = GGUFReader(str(src))
    w = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = [*value, *DELIMITERS]
        elif name == "tokenizer.ggml.token_type":
            value = [*value, USER_DEFINED, USER_DEFINED]
        elif name == "tokenizer.chat_template":
            value = template
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.array(t.data, dtype=np.float32).reshape(shape)
        if t.name in ("token_embd.weight", "output.weight"):
            extra = rng.normal(scale=float(data.std()), size=(2, shape[1])).astype(np.float32)
            data = np.concatenate([data, extra])
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def build_thinking_bundle(source: Path, folder: Path, template: str = QWEN3_TEMPLATE) -> Path:
    """A bundle (f32, float32 KV: exact) of `write_thinking_gguf(source)`."""
    from goinfer.compiler.build import BuildOptions, build

    gguf = write_thinking_gguf(source, folder / "tiny-thinking.gguf", template)
    out = folder / "tiny-thinking.giw"
    build(gguf, out, BuildOptions(quant="f32", num_cores=2, kv_dtype="float32"), progress=lambda _m: None)
    return out


class Scripted:
    """A model's side of a script: `say(text)` sets the sampler to write `text` and end the turn."""

    def __init__(self, model):
        self.model = model
        control = model.thinking
        assert control is not None, "the template's thinking control was not recognised"
        self.close_id = control.close_id
        self.eos = model.single_token("<|im_end|>")

    def ids(self, text: str) -> list[int]:
        return self.model.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def text(self, ids: list[int]) -> str:
        return self.model.decode(ids)

    def say(self, text: str) -> list[int]:
        script = [*self.ids(text), self.eos]
        ScriptedSampler.SCRIPT, ScriptedSampler.CLOSE = script, self.close_id
        ScriptedSampler.SPELL = staticmethod(lambda t: self.model.decode([t]))
        return script


class ScriptedSampler:
    """The runtime's Sampler interface, writing `SCRIPT` (token ids, spelled by `SPELL`) whatever
    the logits say. Where every token but one is masked out (a forced token, or a grammar's only
    choice) it takes that one, and where a grammar forbids the script's token it takes the legal
    token that spells most of what the script still has to say; either way it carries on from the
    script's text after it. A forced `</think>` skips the script past its own. Set the class's
    SCRIPT, SPELL and CLOSE before a generation starts; `forced` lists the reply positions where a
    token was forced, and `prompt` the prompt's ids, in the last run."""

    SCRIPT: ClassVar[Sequence[int]] = ()
    SPELL: ClassVar[Callable[[int], str]] = str
    CLOSE: ClassVar[int | None] = None
    forced: ClassVar[list[int]] = []
    prompt: ClassVar[list[int]] = []

    def __init__(self, params, prompt_ids=()):
        spelled = [self.SPELL(t) for t in self.SCRIPT]
        self.text = "".join(spelled)
        self.next = {}  # char offset of a token boundary -> the script's token there
        at = 0
        for tok, piece in zip(self.SCRIPT, spelled, strict=True):
            self.next[at] = tok
            at += len(piece)
        self.pos = 0
        self.draws = 0
        ScriptedSampler.forced, ScriptedSampler.prompt = [], list(prompt_ids)

    def __call__(self, logits: np.ndarray) -> int:
        legal = np.flatnonzero(np.isfinite(logits))
        self.draws += 1
        if legal.size == 1:
            tok = int(legal[0])
            ScriptedSampler.forced.append(self.draws - 1)
            closes = self.text.find(self.SPELL(tok), self.pos) if tok == self.CLOSE else -1
            if closes >= 0:
                self.pos = closes + len(self.SPELL(tok))
            elif self.text.startswith(self.SPELL(tok), self.pos):
                self.pos += len(self.SPELL(tok))
            return tok
        tok = self.next.get(self.pos)
        if tok is None or not np.isfinite(logits[tok]):
            rest = self.text[self.pos :]
            fits = [int(t) for t in legal if (sp := self.SPELL(int(t))) and rest.startswith(sp)]
            assert fits, f"the script cannot go on here: {rest[:20]!r}"
            tok = max(fits, key=lambda t: len(self.SPELL(t)))
        self.pos += len(self.SPELL(tok))
        return tok
