"""Many generations on one model at once: continuous batching over one paged KV cache.

Each running generation is a thread of its own (sampling, grammar masks, detokenizing: the
`generate_events` loop every path shares), and the scheduler's thread is the only one that
touches the model and its cache. A generation asks for forwards and blocks until its logits
come back:

    Session.prefill()       the prompt, minus the longest prefix a warm sequence already holds
    Session.decode(token)   one token

Each scheduler step runs
1. every decode token submitted since the last step, as one `batch_decode` forward that reads
   each weight once for all of them (one alone takes the static single-token `decode`); it waits
   up to GATHER_S for the running generations that have not submitted yet;
2. then one chunk (at most `prefill_chunk` tokens) of the oldest waiting prompt, so a long prompt
   that arrives mid-decode holds the others up one chunk at a time, never for its whole length.
Prompt chunks are never packed into a decode forward (decode steps stay one token a sequence, or
a few with --spec ngram's drafts, which run through the prefill graph and give the same bits).
Batched rows equal single rows bit for bit (each kernel computes a row the same way whatever
the batch), a token computes the same wherever its prompt's chunks were cut, and a reused prefix
is exactly what a cold run computes (runtime/kv_pool.py): so at temperature 0 a conversation's reply is the
one it gets alone, on a cold server.

Pages. Before each forward the scheduler makes room: warm sequences go first, least recently
used. A prompt that still cannot get pages waits while others run, and fails (KVCacheFull) when
nothing else could free them. A decode step short of pages preempts the youngest generations:
their KV is dropped and recomputed from their tokens once pages free up, invisibly to them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import SchedulerConfig
from .decode import Detokenizer, GenerationRequest, StepEvent, generate_events
from .kv_pool import KVPool, Seq
from .session_files import SessionFiles
from .session_store import SavedSession
from .speculate import Lookahead, NgramDrafter

log = logging.getLogger("goinfer.runtime")

GATHER_S = 0.003  # how long a decode step waits for running generations still sampling
PROBE_ROUNDS = 5  # --cpu-batch auto's measurement: decode steps timed each way
BATCH_GAIN = 0.9  # batch when a batched step of two costs at most this much of two single ones
CANCEL_POLL_S = 0.1  # how often an idle or blocked scheduler looks for prompts whose client left


class Cancelled(Exception):
    """The request's client left; its generation stops at the next step."""


class KVCacheFull(Exception):
    """No pages for this prompt, and none will free up (nothing else is running)."""


class _Job:
    """A forward a generation waits on: its result (logits) or its error."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None

    def finish(self, result: np.ndarray | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def wait(self) -> np.ndarray:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass(eq=False)
class Session:
    """One generation's hold on the cache: its sequence, and what it has asked for."""

    scheduler: Scheduler
    prompt: list[int]
    cancel: threading.Event
    seq: Seq | None = None
    cached: int = 0  # prompt tokens the cache already held
    fed: int = 0  # prompt tokens fed so far (cached ones included)
    admitted: float = field(default_factory=time.monotonic)
    job: _Job | None = None
    pending: list[int] = field(default_factory=list)  # tokens to (re)feed: the prompt, or a preempted history
    spec: Lookahead | None = None  # --spec ngram / --drafter: its drafts (runtime/speculate.py)
    # n > 1: the other choices of its request, which start from a copy of its prompt's KV
    followers: list[Session] = field(default_factory=list)
    follows: bool = False  # a follower: its prompt is another's, its first job made in advance

    def prefill(self) -> tuple[np.ndarray, int]:
        job = self.job if self.follows and self.job is not None else self.scheduler._submit_prefill(self)
        return job.wait(), self.cached

    def decode(self, token: int) -> np.ndarray:
        if self.cancel.is_set():
            raise Cancelled()
        return self.scheduler._submit_decode(self, token).wait()

    def close(self) -> None:
        self.scheduler._submit_release(self)


class Scheduler:
    def __init__(self, model, config: SchedulerConfig = SchedulerConfig()):  # noqa: B008 - frozen
        self.model, self.config = model, config
        if config.context:  # a window smaller than the model's: every request is held to it
            model.context_length = min(model.context_length, config.context)
        self.chunk = max(1, min(config.prefill_chunk, model.prefill_chunk))
        self.capacity = config.kv_tokens or model.context_length
        kv = model.create_cache(max(1, config.max_concurrent), self.capacity)
        page = model.manifest.kv_cache.page_size
        exact, on_host = config.prefix_reuse == "exact", model.device == "cpu"
        self.pool = KVPool(kv, page, config.kv_sessions, self.chunk, exact, on_host)
        self.probe: tuple[float, float] | None = None  # (two single steps, one batched step of two), s
        self.batch = config.batch == "on" or (config.batch == "auto" and self._batching_pays())
        # --drafter: a small model's cache beside the target's. Drafts run on the CPU only, where a
        # forward's rows are single steps' bit for bit (kv_pool granule 1)
        self.draft = None
        if config.drafter and self.pool.granule == 1:
            from .draft_model import load_drafter

            self.draft = load_drafter(config.drafter, model, self.capacity, config, self.chunk)
        elif config.drafter:
            log.info("--drafter: speculation runs on the CPU only; %s decodes without it", model.device)
        self.sessions = (
            SessionFiles(config.session_dir, model.bundle.header_sha256) if config.session_dir else None
        )
        if self.sessions is not None:
            self.pool.on_drop = lambda seq: self.sessions.forget(seq.key)
            self._restore()
        self._cond = threading.Condition()
        self._prefills: deque[Session] = deque()
        self._decodes: list[tuple[Session, int]] = []
        self._releases: list[Session] = []
        self._barriers: list[_Job] = []
        self._decoding: set[Session] = set()  # sessions past their prompt: each will submit a token or close
        # choices of n whose prompt copy found no room: each waits for a release (scheduler thread only)
        self._deferred: deque[Session] = deque()
        self._stopped = False
        self._blocked = False  # the head prompt waits for pages: only a release can free them
        self._stats = self._count()
        # Totals since start, for the server's /metrics (ints written on the scheduler thread, read anywhere)
        self.preemptions = self.drafted = self.accepted = 0
        self._thread = threading.Thread(target=self._loop, name="goinfer-scheduler", daemon=True)
        self._thread.start()

    def _batching_pays(self) -> bool:
        """--cpu-batch auto: time two sequences' decode steps, one forward each against one forward
        for both, on this machine and model, and batch if that is faster by BATCH_GAIN or more."""
        if self.config.max_concurrent < 2 or self.model.prefill_chunk < 2:
            return False
        seqs = [self.pool.new() for _ in range(2)]
        kv, ids = self.pool.kv, [q.id for q in seqs]
        try:
            for q in seqs:  # a little context, as a real step has
                self.model.run(kv, [q.id], [[1, 2, 3, 4][: self.model.prefill_chunk]])
            single, batched = [], []
            for _ in range(PROBE_ROUNDS):
                t0 = time.perf_counter()
                for q in ids:
                    self.model.run(kv, [q], [[5]])
                t1 = time.perf_counter()
                self.model.run(kv, ids, [[6], [6]])
                single.append(t1 - t0)
                batched.append(time.perf_counter() - t1)
        finally:
            for q in seqs:
                self.pool.drop(q)
        self.probe = (float(np.median(single)), float(np.median(batched)))
        return self.probe[1] <= BATCH_GAIN * self.probe[0]

    # -- the generation side (any thread) --------------------------------------------------
    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        """As `Model.generate`, on a sequence of the shared cache; `cancel` set stops it at the
        next step (mid-prompt: between chunks) and frees its sequence."""
        session = Session(self, self._checked(request.prompt_ids), cancel or threading.Event())
        return self._run(request, session)

    def generate_choices(
        self, requests: Sequence[GenerationRequest], cancel: threading.Event | None = None
    ) -> list[Iterator[StepEvent]]:
        """Several continuations of one prompt (OpenAI's `n`), one request each (its own seed,
        its own grammar), to be iterated on threads of their own. The prompt is prefilled once, by
        the first; each other choice starts from a copy of that KV (KVPool.fork): the same bits, so
        each choice is the reply its request gets alone. A choice with no room for its copy waits
        for a generation to end and then takes over its warm sequence (a sibling's holds the whole
        prompt); on a GPU, whose cache never copies, each prefills the prompt. `cancel` stops them all."""
        ids = self._checked(requests[0].prompt_ids)
        cancel = cancel or threading.Event()
        first = Session(self, ids, cancel)
        others = [Session(self, ids, cancel, job=_Job(), follows=True) for _ in requests[1:]]
        first.followers = others
        return [self._run(r, s) for r, s in zip(requests, [first, *others], strict=True)]

    def _run(self, request: GenerationRequest, session: Session) -> Iterator[StepEvent]:
        m, ids = self.model, session.prompt
        try:
            yield from generate_events(
                request,
                Detokenizer(m.tokenizer, ids),
                session.prefill,
                session.decode,
                m.context_length,
                m.stop_ids,
            )
        finally:
            session.close()

    def score(self, prompt_ids: list[int], cancel: threading.Event | None = None) -> tuple[np.ndarray, int]:
        """The logits after the prompt's last token, and how many of its tokens the cache already
        held: a prefill and no decode (label scoring, serve/decisions.py). The sequence stays warm,
        so prompts that share a prefix (questions about one state) prefill it once."""
        session = Session(self, self._checked(prompt_ids), cancel or threading.Event())
        try:
            return session.prefill()
        finally:
            session.close()

    def _checked(self, prompt_ids) -> list[int]:
        """The prompt as a list, refused (ValueError) when empty or not within the window."""
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.model.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context window is {self.model.context_length}"
            )
        return ids

    def _submit_prefill(self, s: Session) -> _Job:
        with self._cond:
            s.job, s.pending = _Job(), s.prompt
            self._prefills.append(s)
            self._cond.notify()
            return s.job

    def _submit_decode(self, s: Session, token: int) -> _Job:
        with self._cond:
            s.job = _Job()
            row = s.spec.take(token) if s.spec is not None else None
            if row is not None:  # sampling picked the next draft: its logits are there
                s.job.finish(row)
                return s.job
            self._decodes.append((s, token))
            self._cond.notify()
            return s.job

    def _submit_release(self, s: Session) -> None:
        with self._cond:
            self._releases.append(s)
            self._cond.notify()

    def sync(self) -> None:
        """Return once every release posted so far is done (tests, saving sessions)."""
        with self._cond:
            job = _Job()
            self._barriers.append(job)
            self._cond.notify()
        job.done.wait()

    def stop(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)
        if self.sessions is not None:  # what is warm now, with its KV, before the process goes
            # newest first: if an export must free a page, the oldest keeps its ids only
            for seq in sorted((q for q in self.pool.seqs.values() if not q.busy), key=lambda q: -q.last_used):
                if seq.id in self.pool.seqs:
                    self._save(seq, with_kv=True)
            self.sessions.close()

    def stats(self) -> dict[str, int]:
        """For /health: sequences kept warm and running, pages used and free, as of the last step
        (counted on the scheduler's thread: the cache is not read from another)."""
        return dict(self._stats)

    def _count(self) -> dict[str, int]:
        pool = self.pool
        total, free, warm = -(-self.capacity // pool.page_size) + 1, pool.free_pages(), pool.warm
        return {
            "sessions_warm": warm,
            "sessions_running": len(pool.seqs) - warm,
            "pages_used": total - free,
            "pages_free": free,
            "page_size": pool.page_size,
        }

    # -- sessions on disk (--session-dir) ----------------------------------------------------
    def _save(self, seq: Seq, with_kv: bool = False) -> None:
        """Write `seq`'s session: its ids after a request (cheap: a crash loses only KV that can be
        recomputed), its KV too at shutdown (bytes per token: megabytes a session)."""
        assert self.sessions is not None
        if len(seq.tokens) <= seq.saved and not with_kv:
            return
        kv = None
        if with_kv:
            try:
                kv = self.pool.export(seq)
            except Exception as e:  # a session not saved must not fail anything around it
                log.warning("could not export session %s: %s", seq.key, e)
        meta, groups = kv or (None, [])
        saved = SavedSession(
            seq.key, list(seq.tokens), seq.last_used, seq.exact, meta, tuple(groups), self.pool.granule
        )
        seq.saved = len(seq.tokens)
        self.sessions.write(saved)

    def _restore(self) -> None:
        """(before the thread starts) The newest saved sessions, warm in the pool again, each checked
        whole before it touches the model. One saved with its KV comes back by import, bit for bit
        as it was, in time proportional to its bytes; one saved with its ids only (after each
        request; a cache on a GPU) is fed again from them in a cold run's chunks, so it is exact too."""
        assert self.sessions is not None
        t_read, keep = time.perf_counter(), []
        for saved in self.sessions.load_all():
            why = self._refusal(saved)
            if why is not None:
                self.sessions.set_aside(saved.key, why)
            elif len(keep) < self.config.kv_sessions:
                keep.append(saved)
        t0, imported, fed = time.perf_counter(), 0, 0
        t_read = t0 - t_read
        for s in keep:
            # its pages, and one for the import's scratch sequence
            if not self.pool.make_room(self.pool.pages_for(Seq(-1), len(s.tokens)) + 2):
                break  # the rest would not fit the cache
            if s.kv_metadata is not None and self._import(s):
                imported += 1
                continue
            seq = self.pool.new_warm(s.key, s.last_used)
            for at in range(0, len(s.tokens), self.chunk):  # a cold run's chunks
                piece = s.tokens[at : at + self.chunk]
                self.model.run(self.pool.kv, [seq.id], [piece])
                self.pool.computed(seq, piece)
            seq.busy, seq.saved = False, len(seq.tokens)
            fed += 1
        if keep:
            took = time.perf_counter() - t0
            log.info("restored %d sessions from %s: files read and checked in %.1fs, then warm in %.1fs "
                     "(%d by KV import, %d fed again from their ids)",
                     imported + fed, self.sessions.folder, t_read, took, imported, fed)  # fmt: skip

    def _import(self, s: SavedSession) -> bool:
        # reusable in granules of another size (another chunk, or a GPU's): a cold run's only from 0
        exact = s.exact if s.chunk == self.pool.granule else 0
        try:
            self.pool.adopt_import(s.tokens, s.kv_metadata, list(s.kv_groups), s.key, s.last_used, exact)
        except ValueError as e:  # checked, yet refused: fed again from its ids instead
            log.warning("session %s: KV import refused (%s); feeding its ids again", s.key, e)
            return False
        return True

    def _refusal(self, s: SavedSession) -> str | None:
        """Why a saved session must not touch this model, or None. The file's checksum only says it
        is the file we wrote: its contents still decide what reaches the kernels."""
        m, n = self.model, len(s.tokens)
        if not 0 < n < m.context_length:
            return f"{n} tokens, outside 1..{m.context_length - 1} (the context window)"
        if n > self.capacity:
            return f"{n} tokens, over the KV cache's {self.capacity}"
        ids = np.asarray(s.tokens, np.int64)
        if ids.min() < 0 or ids.max() >= m.spec.vocab_size:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            return f"token id {bad} is outside the vocabulary (size {m.spec.vocab_size})"
        if not 0 <= s.exact <= n or (s.chunk and s.exact % s.chunk):
            return f"{s.exact} exact tokens of {n} are not whole prefill chunks of {s.chunk}"
        if s.kv_metadata is not None:
            layout = {"num_layers": m.spec.num_layers, "num_kv_heads": m.spec.num_kv_heads,
                      "qk_head_dim": m.spec.head_dim, "dtype": m.manifest.kv_cache.dtype}  # fmt: skip
            return self.pool.import_problem(s.tokens, s.kv_metadata, list(s.kv_groups), layout)
        return None

    # -- the scheduler's thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped
                    or self._releases
                    or self._barriers
                    or self._decodes
                    or self._ready_prefill()
                ):
                    self._cond.wait(CANCEL_POLL_S)
                    self._drop_cancelled()
                if self._stopped:  # finished generations still go back to the pool (and to disk)
                    releases, self._releases = self._releases, []
                    break
                self._gather()
                releases, self._releases = self._releases, []
                barriers, self._barriers = self._barriers, []
                self._blocked = self._blocked and not releases
                decodes, self._decodes = self._decodes, []
                waiting = self._prefills[0] if self._ready_prefill() else None
            try:
                for s in releases:
                    self._release(s)
                for b in barriers:
                    b.finish(np.zeros(0))
                if decodes:
                    self._decode_step(decodes)
                if waiting is not None:
                    self._prefill_step(waiting)
                self._stats = self._count()
            except Exception:  # a bug here must not hang every waiting generation
                log.exception("scheduler step failed")
                self._fail_all(RuntimeError("the scheduler failed; see the server log"))
        for s in releases:
            self._release(s)
        self._fail_all(RuntimeError("the model was unloaded"))

    def _drop_cancelled(self) -> None:
        """(lock held) Prompts whose client left while they waited end now, not when their turn comes."""
        for s in [s for s in self._prefills if s.cancel.is_set()]:
            self._end_prefill(s, error=Cancelled())
        for s in [s for s in self._deferred if s.cancel.is_set()]:
            self._deferred.remove(s)
            s.job.finish(error=Cancelled())

    def _ready_prefill(self) -> bool:
        return bool(self._prefills) and not self._blocked

    def _gather(self) -> None:
        """Wait (lock held) up to GATHER_S for running generations still sampling their token."""
        if not self._decodes or not self.batch:
            return
        deadline = time.monotonic() + GATHER_S
        while len(self._decodes) < len(self._decoding) and not self._releases:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _release(self, s: Session) -> None:
        self._decoding.discard(s)
        if self._deferred:  # a choice short of room for its prompt's copy: this sequence's pages, or
            # its whole prompt when `s` was a sibling (its warm sequence holds it: reused, not recomputed)
            with self._cond:
                self._prefills.append(self._deferred.popleft())
        with self._cond:
            if s in self._prefills:
                self._prefills.remove(s)
        self._drop_drafts(s)
        if s.spec is not None:  # one line a generation under --spec / --drafter
            log.info(s.spec.log_line())
            self.drafted += sum(d.drafted for d in s.spec.drafters)
            self.accepted += sum(d.accepted for d in s.spec.drafters)
            s.spec.close()
        seq, s.seq = s.seq, None
        if seq is not None and seq.id in self.pool.seqs:
            self.pool.release(seq)
            if self.sessions is not None and seq.id in self.pool.seqs:
                self._save(seq)

    def _room(self, needs: list[tuple[Seq, int]]) -> bool:
        pages = sum(self.pool.pages_for(seq, n) for seq, n in needs) + 1
        return self.pool.make_room(pages)

    def _decode_step(self, decodes: list[tuple[Session, int]]) -> None:
        live = []
        for s, token in decodes:
            self._drop_drafts(s)  # sampling picked another token than the next draft
            if s.cancel.is_set():
                s.job.finish(error=Cancelled())
            else:
                live.append((s, token))
        # a forward's tokens fit the cache's prefill chunk. Drafts only when one generation decodes:
        # batching already shares each weight read between several, and drafting beside them cost
        # 4 clients 12% of their aggregate (1.5B, prose) and gained 2% on code edits
        size = max(1, min(self.config.max_concurrent, self.model.prefill_chunk)) if self.batch else 1
        drafts = self.model.prefill_chunk - 1 if len(live) == 1 else 0
        feeds = [(s, self._feed(s, token, drafts)) for s, token in live]
        # Short of pages: preempt the youngest until the rest fit.
        feeds.sort(key=lambda sf: sf[0].admitted)
        while feeds and not self._room([(s.seq, len(feed)) for s, feed in feeds]):
            s, feed = feeds.pop()
            self._preempt(s, feed[0])
        for i in range(0, len(feeds), size):
            self._run_decode(feeds[i : i + size])

    def _speculating(self) -> bool:
        """--spec ngram or --drafter, where a forward's rows are single steps' bit for bit (a CPU
        cache: kv_pool granule 1)."""
        return (self.config.spec == "ngram" or self.draft is not None) and self.pool.granule == 1

    def _lookahead(self, tokens: list[int]) -> Lookahead:
        drafters = [NgramDrafter(tokens)] if self.config.spec == "ngram" else []
        if self.draft is not None:  # after the n-grams: the text's own repeats are free to draft
            drafters.append(self.draft.follow(tokens))
        return Lookahead(drafters)

    def _feed(self, s: Session, token: int, limit: int) -> list[int]:
        """`token`, and with --spec ngram or --drafter up to `limit` drafts after it
        (runtime/speculate.py)."""
        if not self._speculating():
            return [token]
        if s.spec is None:
            s.spec = self._lookahead(s.seq.tokens)
        room = self.model.context_length - len(s.seq.tokens) - 2  # the window: token, and one more
        return s.spec.feed(token, min(limit, room))

    def _drop_drafts(self, s: Session) -> None:
        """The drafts still ahead of what `s` sampled leave the cache (and its pages)."""
        n = s.spec.dropped() if s.spec is not None else 0
        if n and s.seq is not None and s.seq.id in self.pool.seqs:
            self.pool.pop(s.seq, n)

    def _run_decode(self, batch: list[tuple[Session, list[int]]]) -> None:
        seqs = [s.seq for s, _ in batch]
        feeds = [feed for _, feed in batch]
        drafting = any(len(feed) > 1 for feed in feeds)
        try:  # with drafts: every fed position's logits
            rows = self.model.run(self.pool.kv, [q.id for q in seqs], feeds, every_position=drafting)
        except Exception as e:
            for s, _ in batch:
                s.job.finish(error=e)
            return
        at = 0
        for s, feed in batch:
            mine = rows[at : at + len(feed)] if drafting else rows[at : at + 1]
            at += len(mine)
            self.pool.computed(s.seq, feed)  # reusable as prefilled tokens, on the CPU
            if s.spec is not None:
                s.spec.fed(feed, mine)
            s.job.finish(mine[0])

    def _preempt(self, s: Session, token: int) -> None:
        """Drop `s`'s KV; it is recomputed from its tokens (and `token`) as a prompt, first in line."""
        log.info("KV cache full: preempting a generation of %d tokens", len(s.seq.tokens))
        self.preemptions += 1
        history = [*s.seq.tokens, token]
        self.pool.drop(s.seq)
        s.seq, s.pending, s.fed = None, history, 0
        self._decoding.discard(s)
        with self._cond:
            self._prefills.appendleft(s)
            self._blocked = False  # its pages are free now: the head prompt may fit

    def _prefill_step(self, s: Session) -> None:
        if s.cancel.is_set():
            return self._end_prefill(s, error=Cancelled())
        if s.seq is None:  # first chunk: find the longest warm prefix
            s.seq, reused = self.pool.acquire(s.pending)
            s.fed = reused
            if s.pending is s.prompt:
                s.cached = reused
        chunk = s.pending[s.fed : s.fed + self.chunk]
        need = [(s.seq, len(chunk))]
        if not self._room(need) and not (self._unfeed_others(s) and self._room(need)):
            if self._decoding:
                self._blocked = True  # running generations hold the pages; they free them as they end
                return
            return self._end_prefill(
                s,
                error=KVCacheFull(
                    f"the KV cache ({self.capacity} tokens) has no room for a {len(s.pending)}-token prompt"
                ),
            )
        try:
            logits = self.model.run(self.pool.kv, [s.seq.id], [chunk])
        except Exception as e:
            return self._end_prefill(s, error=e)
        self.pool.computed(s.seq, chunk)
        s.fed += len(chunk)
        # the drafter's cache takes the prompt a chunk beside the target's; not while others decode
        # (it drafts only for a generation alone, and catches up then, a chunk a round)
        if self.draft is not None and not self._decoding:
            if s.spec is None:
                s.spec = self._lookahead(s.prompt)
            s.spec.catch_up(len(s.seq.tokens))
        if s.fed == len(s.pending):
            self._decoding.add(s)
            self._end_prefill(s, result=logits[-1])

    def _unfeed_others(self, head: Session) -> bool:
        """Free the pages of prompts waiting behind `head` half fed (a preempted generation put back
        in front of one mid-prompt): they are fed again from their start when their turn comes.
        Without this, both wait for pages the other holds. Whether any were freed."""
        with self._cond:
            others = [w for w in self._prefills if w is not head and w.seq is not None]
        for w in others:
            if w.seq.id in self.pool.seqs:
                self.pool.drop(w.seq)
            w.seq, w.fed = None, 0
        return bool(others)

    def _end_prefill(
        self, s: Session, result: np.ndarray | None = None, error: BaseException | None = None
    ) -> None:
        with self._cond:
            if s in self._prefills:
                self._prefills.remove(s)
        if s.followers:  # before `s` samples: its sequence holds exactly the prompt
            self._start_followers(s, result, error)
        s.job.finish(result, error)

    def _start_followers(self, s: Session, logits: np.ndarray | None, error: BaseException | None) -> None:
        """The other choices of `s`'s request: each decodes from a copy of `s`'s prompt KV and
        logits, or shares its error; one that cannot be copied prefills the prompt itself."""
        followers, s.followers = s.followers, []
        for f in followers:
            if error is not None or f.cancel.is_set():
                f.job.finish(error=error or Cancelled())
                continue
            seq = self.pool.fork(s.seq) if logits is not None else None
            if seq is None:  # its own prefill; its job is the one it waits on
                f.pending = f.prompt
                if self.pool.on_host:  # short of room: after a release, from a sibling's warm sequence
                    self._deferred.append(f)
                else:  # a GPU cache never copies: the choices prefill side by side
                    with self._cond:
                        self._prefills.append(f)
                continue
            f.seq, f.fed, f.cached = seq, len(f.prompt), len(f.prompt)
            self._decoding.add(f)
            f.job.finish(logits.copy())

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            jobs = [s.job for s in self._prefills] + [s.job for s, _ in self._decodes]
            jobs += [f.job for s in self._prefills for f in s.followers]  # waiting on a prompt that fails
            jobs += [s.job for s in self._deferred]
            self._deferred.clear()
            self._prefills.clear()
            self._decodes.clear()
        for job in jobs:
            if job is not None and not job.done.is_set():
                job.finish(error=error)
