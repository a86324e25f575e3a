"""`goinfer chat MODEL`: a conversation in the terminal on the runtime, no server.

Three ways in, one command:
- no PROMPT: an interactive REPL. Replies stream as they are sampled; turns run through the same
  scheduler the server uses (runtime/scheduler.py), whose KV pool keeps the conversation warm, so
  a turn prefills only what is new since the last one (its time to first token stays flat as the
  chat grows). History is kept within the context window: the oldest turns go, with a notice.
- PROMPT (or, with --json / --schema, stdin): one answer, then exit. --json / --schema constrain it
  to JSON through the runtime's grammar (runtime/grammar.py), as the server's response_format does.
- --batch IN.jsonl -o OUT.jsonl: a batch file, run by goinfer.cli.batch_run.

A thinking model (runtime/thinking.py) renders its prompt as --thinking says (/think changes it in
the REPL); its reasoning goes to stderr, dimmed, before the answer (--show-thinking false: a
marker instead), only the answer enters the conversation, and the reasoning budget keeps it room
to answer. A --json / --schema answer is rendered thinking-off, as the server renders a
constrained request.

The imports of the runtime's heavy parts (TVM, the scheduler) are inside the functions: `goinfer
--help` stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import click
from click.core import ParameterSource
from goinfer.compiler.build import BuildOptions
from goinfer.runtime.config import SchedulerConfig
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.thinking import MODES, ThinkingConfig

from . import options
from .errors import fail, user_errors
from .options import KV_DTYPES, knob

PROMPT, MORE = ">>> ", "... "
CONTINUE = "\\"  # a line ending in it goes on on the next line
# The sampling flags a --batch run passes on only when given (a batch line's own settings, or the
# API's defaults, hold otherwise).
OVERRIDES = ("temperature", "seed", "max_tokens", "system", "top_p", "top_k")
HELP = """commands:
  /system TEXT   set the system prompt (/system alone removes it)
  /clear         forget the conversation (the system prompt and settings stay)
  /temp X        set the temperature (/temp alone shows it)
  /think MODE    a thinking model's mode: template, asis, on or off (/think alone shows it)
  /save FILE     write the conversation (messages and settings) as JSON
  /load FILE     read one written by /save
  /help          this list
  /quit          leave (or Ctrl-D; Ctrl-C twice at an empty prompt)
a line ending in \\ continues on the next; Ctrl-C stops a reply"""


@dataclass(frozen=True)
class ChatConfig:
    """The chat's sampling defaults: the CLI's flags read theirs from here. Those of `goinfer
    generate` (llama.cpp's CLI filters), with a reply long enough for a chat answer."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    max_tokens: int = 512
    system: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.max_tokens,
        )


# The REPL's cache: one conversation warm, and one spare so a /clear or /system does not evict it
# before the next turn has found its prefix.
REPL_ENGINE = SchedulerConfig(max_concurrent=1, kv_sessions=2)
SETTINGS = ("temperature", "top_p", "top_k", "seed", "max_tokens")
ROLES = ("user", "assistant")


# -- the conversation: messages and settings, saved and loaded as JSON ---------------------------
@dataclass
class Conversation:
    config: ChatConfig
    turns: list[dict[str, str]] = field(default_factory=list)  # user and assistant, alternating

    def messages(self) -> list[dict[str, str]]:
        system = self.config.system
        return ([{"role": "system", "content": system}] if system else []) + self.turns

    def drop_oldest(self) -> bool:
        """Forget the oldest exchange (a user turn and the replies after it); False when only the
        latest user turn is left."""
        users = [i for i, t in enumerate(self.turns) if t["role"] == "user"]
        if len(users) < 2:
            return False
        del self.turns[: users[1]]
        return True

    def to_json(self) -> dict[str, Any]:
        settings = {k: getattr(self.config, k) for k in SETTINGS}
        return {"messages": self.messages(), "settings": settings}

    @classmethod
    def from_json(cls, data: Any, base: ChatConfig) -> Conversation:
        """As /save wrote it: {"messages": [...], "settings": {...}}; ValueError says what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise ValueError('not a saved conversation: no "messages" list')
        settings = data.get("settings") or {}
        if not isinstance(settings, dict) or set(settings) - set(SETTINGS):
            raise ValueError(f'"settings" may hold only {", ".join(SETTINGS)}')
        system, turns = None, []
        for i, m in enumerate(data["messages"]):
            role = m.get("role") if isinstance(m, dict) else None
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: not a message with text content")
            if role == "system" and i == 0:
                system = m["content"]
            elif role in ROLES:
                turns.append({"role": role, "content": m["content"]})
            else:
                raise ValueError(f"messages[{i}]: role {role!r} (system first, then user and assistant)")
        try:
            config = dataclasses.replace(base, system=system, **settings)
            config.sampling()
        except TypeError as e:
            raise ValueError(f"settings: {e}") from None
        return cls(config, turns)


# -- one turn on the runtime ------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    text: str  # the answer (a thinking model's reasoning is not part of it)
    finish: str  # "stop" | "length" | "interrupted"
    prompt_tokens: int
    cached_tokens: int  # of them, how many the KV cache already held
    completion_tokens: int
    ttft_s: float  # from Enter to the first token (the whole reply, when it is empty)
    decode_tok_s: float

    def stats_line(self) -> str:
        return (
            f"[prompt {self.prompt_tokens} tok, {self.cached_tokens} cached | ttft {self.ttft_s:.3f} s | "
            f"{self.completion_tokens} tok, {self.decode_tok_s:.1f} tok/s | {self.finish}]"
        )


class TooLong(ValueError):
    pass


class Thoughts:
    """A thinking model's reasoning on stderr, dimmed, before its answer; with `show` False, one
    "(thinking…)" marker instead. `end()` closes it once the answer starts."""

    def __init__(self, show: bool = True, err: TextIO | None = None):
        self.show, self.err = show, err
        self.open = False

    def __call__(self, text: str) -> None:
        if not self.open:
            self.open = True
            if not self.show:
                click.echo(click.style("(thinking…)", dim=True), nl=False, err=True, file=self.err)
        if self.show:
            click.echo(click.style(text, dim=True), nl=False, err=True, file=self.err)

    def end(self) -> None:
        if self.open:
            self.open = False
            click.echo("", err=True, file=self.err)


def reasoning_for(model, ids: list[int], thinking: ThinkingConfig):
    """(the reasoning budget, the split) of a reply to `ids`; (None, None) for a model without a
    thinking control."""
    from goinfer.runtime.thinking import ReasoningSplit

    control = model.thinking
    if control is None:
        return None, None
    budget = control.budget(ids, thinking)
    return budget, ReasoningSplit(control, budget.inside)


def thinking_vars(model, thinking: ThinkingConfig) -> dict[str, Any]:
    """The template variables `thinking`'s mode renders a prompt with."""
    from goinfer.runtime.thinking import chat_vars

    return chat_vars(model.thinking, thinking.enable())


class ChatEngine:
    """A loaded model and its scheduler: a conversation's turns as prompts that extend each other."""

    def __init__(
        self,
        model,
        engine: SchedulerConfig = REPL_ENGINE,
        thinking: ThinkingConfig = ThinkingConfig(),  # noqa: B008 - frozen
    ):
        from goinfer.runtime.scheduler import Scheduler

        self.model = model
        self.thinking = thinking  # /think changes its mode
        self.scheduler = Scheduler(model, engine)  # applies --ctx to model.context_length

    @property
    def window(self) -> int:
        return self.model.context_length

    def fit(self, conv: Conversation) -> tuple[list[int], int]:
        """The conversation's prompt ids, leaving room for a reply (max_tokens, at most half the
        window). When it does not fit, the oldest exchanges go until the prompt is under half what
        is left, so the next turns extend this prompt (and reuse its cache) instead of each
        dropping one more. Returns (ids, exchanges dropped)."""
        room = self.window - min(conv.config.max_tokens, self.window // 2)
        kept = list(conv.turns)
        variables = thinking_vars(self.model, self.thinking)
        ids, dropped = self.model.chat_prompt(conv.messages(), **variables), 0
        while len(ids) > (room if not dropped else room // 2) and conv.drop_oldest():
            ids, dropped = self.model.chat_prompt(conv.messages(), **variables), dropped + 1
        if len(ids) > room:
            conv.turns[:] = kept  # the history stays as it was; only this message is refused
            raise TooLong(
                f"the message makes a prompt of {len(ids)} tokens; with room for a reply the "
                f"context window ({self.window}) takes {room}"
            )
        return ids, dropped

    def reply(
        self,
        ids: list[int],
        sampling: SamplingParams,
        write: Callable[[str], None],
        cancel: threading.Event,
        t0: float,
        think: Callable[[str], None] = lambda _text: None,
    ) -> Turn:
        """Run one turn's prompt (from `fit`); `write` gets the answer's text as it comes and
        `think` a thinking model's reasoning, `t0` is when the user pressed Enter. Setting `cancel`
        ends it at the next step (finish "interrupted")."""
        from goinfer.runtime.decode import GenerationRequest
        from goinfer.runtime.scheduler import Cancelled

        parts: list[str] = []
        ttft, cached, finish, timings = None, 0, "interrupted", {}
        budget, split = reasoning_for(self.model, ids, self.thinking)
        events = self.scheduler.generate(GenerationRequest(ids, sampling, reasoning=budget), cancel)
        try:
            with contextlib.closing(events):  # a reply left early frees its sequence now
                for ev in events:
                    if ttft is None and (ev.token_id is not None or ev.finish_reason is not None):
                        ttft, cached = time.perf_counter() - t0, int(ev.timings.get("cached_tokens", 0))
                    if cancel.is_set():
                        break  # what was sampled after Ctrl-C is neither shown nor kept
                    thought, text = split.push(ev.token_id, ev.text) if split else ("", ev.text)
                    if thought:
                        think(thought)
                    if text:
                        parts.append(text)
                        write(text)
                    if ev.finish_reason is not None:
                        finish, timings = ev.finish_reason, ev.timings
        except Cancelled:
            pass
        return Turn(
            "".join(parts),
            finish,
            len(ids),
            cached,
            int(timings.get("completion_tokens", len(parts))),
            time.perf_counter() - t0 if ttft is None else ttft,
            float(timings.get("decode_tok_s", 0.0)),
        )

    def close(self) -> None:
        self.scheduler.stop()


# -- the REPL -----------------------------------------------------------------------------------------
class Repl:
    def __init__(
        self,
        engine: ChatEngine,
        conv: Conversation,
        out: TextIO,
        verbose: bool,
        tty: bool,
        show_thinking: bool = True,
    ):
        self.engine, self.conv, self.out, self.verbose, self.tty = engine, conv, out, verbose, tty
        self.thoughts = Thoughts(show_thinking)
        self.turns: list[Turn] = []  # what each reply cost (a bench reads them)

    def say(self, line: str) -> None:
        """A notice: on stderr, so stdout holds only the replies when it is piped."""
        click.echo(line, err=True)

    def read(self) -> str:
        """One message: lines ending in \\ joined with newlines (EOFError at the end of input,
        KeyboardInterrupt on Ctrl-C)."""
        lines: list[str] = []
        while True:
            line = input((MORE if lines else PROMPT) if self.tty else "")
            if line.endswith(CONTINUE):
                lines.append(line[: -len(CONTINUE)])
                continue
            lines.append(line)
            return "\n".join(lines)

    def run(self) -> None:
        if self.tty:
            self.say(f"goinfer chat: {Path(str(self.engine.model.bundle.path)).name}; /help for commands")
        armed = False  # a Ctrl-C at the prompt was just pressed: a second one leaves
        while True:
            try:
                text = self.read()
            except KeyboardInterrupt:
                if armed:
                    self.out.write("\n")
                    return
                armed = True
                self.say("\n(Ctrl-C again, /quit or Ctrl-D to leave)")
                continue
            except EOFError:
                if self.tty:
                    self.out.write("\n")
                return
            armed = False
            if text.startswith("/"):
                if not self.command(text):
                    return
            elif text.strip():
                self.turn(text)

    def turn(self, text: str) -> None:
        t0 = time.perf_counter()
        conv = self.conv
        conv.turns.append({"role": "user", "content": text})
        try:
            ids, dropped = self.engine.fit(conv)
        except ValueError as e:  # too long for the window, or the template refused the messages
            conv.turns.pop()
            self.say(f"error: {e}")
            return
        if dropped:
            self.say(
                f"(dropped the {dropped} oldest exchange(s) to fit the {self.engine.window}-token window)"
            )
        cancel = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())  # Ctrl-C: stop this reply only
        try:
            turn = self.engine.reply(ids, conv.config.sampling(), self._write, cancel, t0, self.thoughts)
        except Exception as e:  # one turn's failure (the cache, the model) is a line, not the end
            conv.turns.pop()
            self.say(f"\nerror: {e}")
            return
        finally:
            signal.signal(signal.SIGINT, previous)
        self.thoughts.end()  # a reply that ended inside its block
        self.out.write("\n")
        self.out.flush()
        if turn.text or turn.finish != "interrupted":  # a stopped reply stays as far as it went
            conv.turns.append({"role": "assistant", "content": turn.text})
        else:  # stopped before its first word: as if the message was never sent
            conv.turns.pop()
        if turn.finish == "interrupted":
            self.say("(reply stopped)")
        if self.verbose:
            self.say(turn.stats_line())
        self.turns.append(turn)

    def _write(self, text: str) -> None:
        self.thoughts.end()
        self.out.write(text)
        self.out.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        conv = self.conv
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/clear":
            conv.turns.clear()
            self.say("(conversation cleared)")
        elif name == "/system":
            conv.config = dataclasses.replace(conv.config, system=arg or None)
            self.say("(system prompt set)" if arg else "(system prompt removed)")
        elif name == "/temp":
            self._temp(arg)
        elif name == "/think":
            self._think(arg)
        elif name in ("/save", "/load") and not arg:
            self.say(f"usage: {name} FILE")
        elif name == "/save":
            try:
                Path(arg).write_text(json.dumps(conv.to_json(), indent=1, ensure_ascii=False) + "\n")
                self.say(f"(saved {len(conv.messages())} messages to {arg})")
            except OSError as e:
                self.say(f"error: {arg}: {e.strerror or e}")
        elif name == "/load":
            self._load(arg)
        else:
            self.say(f"unknown command {name}: /help lists them")
        return True

    def _temp(self, arg: str) -> None:
        if not arg:
            self.say(f"temperature {self.conv.config.temperature}")
            return
        try:
            t = float(arg)
        except ValueError:
            t = -1.0
        if not 0 <= t <= 2:
            self.say(f"error: /temp takes a number from 0 to 2, not {arg!r}")
            return
        self.conv.config = dataclasses.replace(self.conv.config, temperature=t)
        self.say(f"(temperature {t})")

    def _think(self, arg: str) -> None:
        engine = self.engine
        if not arg:
            control = engine.model.thinking
            what = (
                control.describe() if control is not None else "no thinking control (the mode does nothing)"
            )
            self.say(f"thinking {engine.thinking.mode} ({what})")
            return
        if arg not in MODES:
            self.say(f"error: /think takes one of {', '.join(MODES)}, not {arg!r}")
            return
        engine.thinking = dataclasses.replace(engine.thinking, mode=arg)
        self.say(f"(thinking {arg})")

    def _load(self, path: str) -> None:
        try:
            self.conv = Conversation.from_json(json.loads(Path(path).read_text()), self.conv.config)
        except OSError as e:
            self.say(f"error: {path}: {e.strerror or e}")
        except ValueError as e:  # not JSON, or not a conversation
            self.say(f"error: {path}: {e}")
        else:
            self.say(f"(loaded {len(self.conv.messages())} messages from {path})")


# -- one answer: a prompt, maybe JSON-constrained --------------------------------------------------------
def json_grammar(schema_path: str | None) -> str:
    """The grammar --schema FILE (or --json: any JSON object) constrains the answer to: the server's
    response_format rules (serve/pipeline.py), a schema compiled leniently as a non-strict one is."""
    from goinfer.runtime import grammar as g

    if schema_path is None:
        return g.json_schema_grammar({"type": "object"})
    try:
        schema = json.loads(Path(schema_path).read_text())
    except OSError as e:
        raise ValueError(f"--schema {schema_path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"--schema {schema_path}: not JSON ({e})") from None
    try:
        return g.compile_json_schema(schema, lenient=True)
    except g.GrammarError as e:
        raise ValueError(f"--schema {schema_path}: not a usable JSON schema: {e}") from None


def answer_once(
    model,
    conv: Conversation,
    grammar: str | None,
    out: TextIO,
    thinking: ThinkingConfig = ThinkingConfig(),  # noqa: B008 - frozen
    thoughts: Thoughts | None = None,
) -> None:
    """One reply to the conversation's last message, on stdout (a thinking model's reasoning to
    `thoughts`, on stderr). With a grammar the text is held until it is complete JSON (stdout is
    only ever the answer), and the prompt is rendered thinking-off."""
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.grammar import GrammarError

    variables = thinking_vars(model, ThinkingConfig(mode="off") if grammar is not None else thinking)
    ids = model.chat_prompt(conv.messages(), window=model.context_length, **variables)
    try:
        constraint = model.grammar.constraint(grammar) if grammar is not None else None
    except GrammarError as e:
        raise ValueError(f"the schema cannot run on this model: {e}") from None
    budget, split = reasoning_for(model, ids, thinking)
    request = GenerationRequest(ids, conv.config.sampling(), constraint=constraint, reasoning=budget)
    thoughts = thoughts or Thoughts()
    parts, finish = [], None
    for ev in model.generate(request):
        thought, text = split.push(ev.token_id, ev.text) if split else ("", ev.text)
        if thought:
            thoughts(thought)
        if grammar is None and text:
            thoughts.end()
            out.write(text)
            out.flush()
        parts.append(text)
        finish = ev.finish_reason or finish
    thoughts.end()
    text = "".join(parts)
    if grammar is not None:
        try:
            json.loads(text)
        except ValueError:
            why = f"--max-tokens {conv.config.max_tokens}" if finish == "length" else "the model"
            raise ValueError(f"the JSON answer was cut short by {why}: {text[:60]!r}...") from None
        out.write(text)
    out.write("\n")
    out.flush()


# -- --batch: delegated ---------------------------------------------------------------------------------
def run_batch(
    ctx: click.Context,
    model: str,
    batch: str,
    output: str | None,
    max_concurrent: int,
    self_test: bool,
    thinking: ThinkingConfig = ThinkingConfig(),  # noqa: B008 - frozen
):
    """Hand a batch file to goinfer.cli.batch_run; returns its exit status. `overrides` holds only
    the sampling flags given on the command line."""
    if output is None:
        raise ValueError("--batch needs -o OUT.jsonl")
    try:
        from goinfer.cli import batch_run
    except ImportError:
        raise ValueError("--batch: this goinfer has no batch runner (goinfer.cli.batch_run)") from None
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    overrides = {k: ctx.params[k] for k in OVERRIDES if ctx.get_parameter_source(k) in given}
    try:
        return batch_run.run_batch_file(
            model,
            Path(batch),
            Path(output),
            max_concurrent=max_concurrent,
            overrides=overrides,
            self_test=self_test,
            progress=lambda line: click.echo(line, err=True),
            thinking=thinking,
        )
    except OSError as e:  # the input missing, the output not writable
        raise ValueError(f"--batch: {e.filename or batch}: {e.strerror or e}") from None


# -- the command ----------------------------------------------------------------------------------------
@click.command(
    epilog="In the REPL: /system TEXT, /clear, /temp X, /think MODE, /save FILE, /load FILE, /help, /quit. "
    "A line ending in \\ continues on the next (multi-line input). Ctrl-C stops a reply; twice at an "
    "empty prompt (or Ctrl-D) leaves."
)
@click.argument("model")
@click.argument("prompt", required=False)
@knob("--temp", ChatConfig, "temperature", "sampling temperature (0: greedy)", type=click.FloatRange(0, 2))
@knob("--top-p", ChatConfig, "top_p", None, type=click.FloatRange(0, 1))
@knob("--top-k", ChatConfig, "top_k", "0: no cut", type=click.IntRange(min=0))
@knob("--seed", ChatConfig, "seed", "a fixed seed: the same replies each run", type=int)
@knob("--max-tokens", ChatConfig, "max_tokens", "a reply's length at most", type=click.IntRange(min=1))
@knob("--system", ChatConfig, "system", "a system prompt")
@options.thinking
@options.reasoning_budget
@click.option(
    "--show-thinking",
    type=click.BOOL,
    default=True,
    show_default=True,
    help="a thinking model's reasoning, dimmed on stderr before the answer (false: a marker instead)",
)
@click.option("--json", "as_json", is_flag=True, help="one answer that is a JSON object (PROMPT or stdin)")
@click.option(
    "--schema",
    type=click.Path(dir_okay=False),
    default=None,
    help="one answer constrained to this JSON schema (PROMPT or stdin)",
)
@click.option(
    "--batch", type=click.Path(dir_okay=False), default=None, help="run a batch file (JSONL) and exit"
)
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), default=None, help="--batch's output (JSONL)"
)
@knob(
    "--max-concurrent",
    SchedulerConfig,
    "max_concurrent",
    "--batch lines run at once",
    type=click.IntRange(min=1),
)
@knob(
    "--ctx",
    SchedulerConfig,
    "context",
    "cap the context window (0: the model's own)",
    type=click.IntRange(min=0),
)
@knob("--quant", BuildOptions, "quant", "used only when MODEL must be built")
@options.kv_dtype
@click.option(
    "--verbose", "-v", is_flag=True, help="each reply's prompt, cached tokens and timings on stderr"
)
@options.no_selftest
@options.device
@click.pass_context
def chat(
    ctx: click.Context,
    model: str,
    prompt: str | None,
    as_json: bool,
    schema: str | None,
    batch: str | None,
    output: str | None,
    max_concurrent: int,
    context: int,
    quant: str,
    kv_dtype: str,
    verbose: bool,
    no_selftest: bool,
    device: str,
    mode: str,
    budget: str,
    show_thinking: bool,
    **sampling: Any,
) -> None:
    """Chat with MODEL (a .giw, a .gguf or a zoo name) in the terminal: an interactive REPL, or
    one answer to PROMPT. With --json or --schema FILE, one JSON answer to PROMPT (or stdin).
    With --batch IN.jsonl -o OUT.jsonl, a batch file."""
    try:
        if batch is not None:
            if prompt is not None or as_json or schema is not None:
                raise ValueError("--batch takes no PROMPT, --json or --schema")
            thinking = ThinkingConfig(mode=mode, budget=budget)
            sys.exit(run_batch(ctx, model, batch, output, max_concurrent, not no_selftest, thinking))
        structured = as_json or schema is not None
        grammar = json_grammar(schema) if structured else None  # a bad schema fails before the load
        if structured and prompt is None:
            prompt = sys.stdin.read().strip()
            if not prompt:
                raise ValueError("--json / --schema need a PROMPT argument or text on stdin")
        conv = Conversation(ChatConfig(**sampling))
        thinking = ThinkingConfig(mode=mode, budget=budget)
        m = load_model(model, quant, kv_dtype, no_selftest, device)
        if prompt is not None:
            if context:
                m.context_length = min(m.context_length, context)
            conv.turns.append({"role": "user", "content": prompt})
            answer_once(m, conv, grammar, sys.stdout, thinking, Thoughts(show_thinking))
            return
        engine = ChatEngine(m, dataclasses.replace(REPL_ENGINE, context=context), thinking)
        try:
            tty = sys.stdin.isatty()
            if tty:
                with contextlib.suppress(ImportError):  # line editing and ↑ history, where there is one
                    import readline  # noqa: F401
            Repl(engine, conv, sys.stdout, verbose, tty, show_thinking).run()
        finally:
            engine.close()
    except user_errors() as e:
        fail(str(e))
    except ValueError as e:  # bad flags, schema, prompt too long: one line
        fail(str(e))


def load_model(ref: str, quant: str, kv_dtype: str, no_selftest: bool, device: str):
    """MODEL resolved and loaded as `goinfer generate` does (built once into the cache if it must be)."""
    from goinfer.compiler.resolve import resolve
    from goinfer.runtime.model import Model

    bundle = resolve(ref, BuildOptions(quant=quant, kv_dtype=KV_DTYPES[kv_dtype]))
    return Model.load(bundle, self_test=False if no_selftest else None, device=device)
