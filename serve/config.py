"""Server settings, resolved once at startup and frozen."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from goinfer.artifacts import cache
from goinfer.artifacts.manifest import ENCODER_QUANTS
from goinfer.runtime.config import SchedulerConfig
from goinfer.runtime.thinking import ThinkingConfig

MiB = 1 << 20
TEXT_CAP_FLOOR = 4 * MiB  # a body that could never fit a context window is not worth reading
BYTES_PER_CONTEXT_TOKEN = 32  # generous: JSON escapes can turn one token's text into ~30 bytes
SMALL_CAP = 64 * 1024  # admin and GET routes carry a few fields at most
# /v1/embeddings' own cap, whatever the decoders' windows: a batch body grows with its count of
# inputs (up to EmbeddingsConfig.max_inputs of up to max_tokens each), not with a context window
EMBEDDINGS_CAP = 64 * MiB


@dataclass(frozen=True)
class BatchConfig:
    """/v1/files, /v1/batches and /v1/messages/batches (serve/files.py, serve/batches.py): uploads and
    batch state on disk, so a batch outlives the process that ran it."""

    # `goinfer serve --batch-dir`, default `default_batch_dir()`; None (an app made in a test): a temporary
    # folder of the app's own, gone with it, so no test resumes or writes a user's batches
    dir: str | None = None
    max_file_bytes: int = 200 * MiB  # an upload's cap (OpenAI's batch input limit); over it a 413
    max_lines: int = 50_000  # requests a batch (OpenAI's and Anthropic's limit is 100k/50k)
    completion_window_s: int = 24 * 3600  # "24h", the only window either API offers


def default_batch_dir() -> Path:
    """Where `goinfer serve` keeps uploads and batches unless --batch-dir says otherwise."""
    return cache.root() / "batches"


@dataclass(frozen=True)
class BodyCaps:
    """The largest request body each kind of route reads (a larger Content-Length is a 413).

    Which routes take which cap is decided by one registry, middleware.py's `text_body` and
    `embeddings_body` marks; `create_app` fills `text_routes` and `embedding_routes` from it, so the
    banner names the routes the middleware caps."""

    text: int  # the routes whose body carries a prompt (`text_routes`)
    small: int  # every other route
    text_routes: tuple[str, ...] = ()  # "/v1/chat/completions", ...: filled from the app's router
    embeddings: int = EMBEDDINGS_CAP  # the routes whose body carries inputs to embed
    embedding_routes: tuple[str, ...] = ()  # "/v1/embeddings": filled from the app's router
    files: int = BatchConfig.max_file_bytes  # POST /v1/files: --max-file-bytes, whatever the rest

    @classmethod
    def resolve(cls, max_body_bytes: int, context_windows: list[int]) -> BodyCaps:
        """`max_body_bytes` > 0 caps every route alike; 0 derives a cap per route."""
        if max_body_bytes > 0:
            return cls(text=max_body_bytes, small=max_body_bytes, embeddings=max_body_bytes)
        text = max([TEXT_CAP_FLOOR] + [BYTES_PER_CONTEXT_TOKEN * c for c in context_windows])
        return cls(text=text, small=SMALL_CAP, embeddings=EMBEDDINGS_CAP)

    @property
    def largest(self) -> int:
        return max(self.text, self.small, self.embeddings, self.files)

    def describe(self) -> str:
        if self.text == self.small == self.embeddings:
            return f"every route {_size(self.text)}"
        text = ", ".join(self.text_routes) or "prompt routes"
        parts = [f"{text} {_size(self.text)}"]
        if self.embedding_routes:
            parts.append(f"{', '.join(self.embedding_routes)} {_size(self.embeddings)}")
        return "; ".join([*parts, f"other routes {_size(self.small)}"])  # /v1/files: the banner's batch line


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a knob out gets (`serve --temp/--top-p/--top-k/--min-p`, as
    llama-server's); by default the APIs' own: temperature 1, no filters. A harness that sends no
    sampling settings (Claude Code) gets exactly these."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class EmbeddingsConfig:
    """/v1/embeddings (serve/embeddings.py, serve/embed_queue.py): its own queue and worker per
    encoder, beside the generation scheduler's."""

    # What an encoder checkpoint is built with (`serve --embed-quant`, `goinfer embed --quant`); a
    # .giw keeps its own. f32 by default: an encoder is small, and f32 is the reference's numbers
    quant: str = "f32"
    max_batch_tokens: int = 16384  # tokens gathered into one forward from the waiting requests
    max_queue: int = 64  # requests running or waiting per encoder; past it a request is a 429
    max_inputs: int = 2048  # inputs a request (OpenAI's limit)


EMBED_QUANTS = ENCODER_QUANTS  # f32 | q8_0: the modes the compiler builds encoders in
INPUT_TYPES = ("query", "document")  # the Cohere/Voyage convention; document is the default


# How /v1/systemone puts a question to the model (serve/decisions.py): the model's chat template,
# or plain text ending in "Answer:"
DECISIONS_TEMPLATES = ("chat-v1", "bare-v1")


@dataclass(frozen=True)
class SwapGuardConfig:
    """The swap guard (serve/guards.py): generation routes answer 503 once swap used grows past
    `threshold_mb` over what it was at start, until it has stayed back within it for `recover_s`."""

    threshold_mb: int | None = 512  # GOINFER_SWAP_GUARD=MB|off; None: off
    recover_s: float = 30.0  # swap must stay back this long before the guard lets go
    poll_s: float = 1.0  # how often the monitor reads /proc/meminfo (a few microseconds a read)

    @classmethod
    def parse(cls, value: str | None) -> SwapGuardConfig:
        """GOINFER_SWAP_GUARD's value: unset or empty (the default), "off", or a threshold in MB."""
        if value is None or not value.strip():
            return cls()
        if value.strip().lower() == "off":
            return cls(threshold_mb=None)
        if not value.strip().isdigit() or int(value) <= 0:
            raise ValueError(f"GOINFER_SWAP_GUARD={value!r}: expected a threshold in MB (e.g. 512) or off")
        return cls(threshold_mb=int(value))


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    # `--grpc-addr HOST:PORT`: the KServe v2 gRPC service (serve/kserve) in this process, over the same
    # models, key, TLS and limits; None: no gRPC
    grpc_addr: str | None = None
    # `--metrics-addr HOST:PORT`: GET /metrics there instead of on the API's port; open without the key
    # only when bound to loopback (serve/metrics.py). None: on the API's port, behind the key
    metrics_addr: str | None = None
    max_queue: int = 8  # requests that may wait per model behind the running ones
    # Generations per model at once: the scheduler's own figure (its KV cache is sized for them).
    max_concurrent: int = SchedulerConfig.max_concurrent
    max_body_bytes: int = 0  # 0: derived per route (BodyCaps.resolve)
    allow_admin: bool = False
    unload_drain_wait_s: float = 5.0
    tls_cert: str | None = None
    tls_key: str | None = None
    keepalive_s: float = 5.0  # an SSE comment goes out when nothing else has for this long
    poll_s: float = 0.25  # how often a waiting request checks that its client is still there
    retry_after_s: int = 1  # the Retry-After a 429 carries
    responses_store: int = 256  # stored /v1/responses kept for previous_response_id, oldest dropped
    # Browser origins (scheme://host[:port]) besides the server's own that may call the API routes
    # (`--cors-origin`, repeatable); admin routes answer their own origin only (middleware.py).
    cors_origins: tuple[str, ...] = ()
    sampling: SamplingDefaults = SamplingDefaults()
    # Thinking models (`--thinking`, `--reasoning-budget`; runtime/thinking.py, serve/thinking.py)
    thinking: ThinkingConfig = field(default_factory=ThinkingConfig)
    # /v1/systemone (serve/decisions.py): how a question is put to the model, and the per-kind
    # temperatures `goinfer decisions-calibrate` fitted under that template (None: none)
    decisions_template: str = "chat-v1"  # one of DECISIONS_TEMPLATES
    decisions_calibration: str | None = None
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    batch: BatchConfig = BatchConfig()
    # `goinfer serve` arms it (SwapGuardConfig.parse of GOINFER_SWAP_GUARD); an app made in a test has
    # none, so no test halts because the machine it runs on swaps
    swap_guard: SwapGuardConfig = SwapGuardConfig(threshold_mb=None)
    # `--web/--no-web`: the chat page and its Models tab on / (serve/webpage.py). None: on when bound to
    # loopback (the page is only static files; the routes it calls keep their own key and rules)
    web: bool | None = None

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key)

    @property
    def serves_web(self) -> bool:
        return self.web if self.web is not None else self.loopback

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def parse_addr(addr: str) -> tuple[str, int]:
    """'127.0.0.1:8080', '[::1]:8080' or ':8080' (all interfaces) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--addr {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"
