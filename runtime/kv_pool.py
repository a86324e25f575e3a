"""Many sequences in one paged KV cache: who holds which tokens, prefix reuse, and pages.

Every sequence the cache holds is a `Seq` with the exact token ids its KV was computed from. A
running request owns its sequence; a finished one leaves it warm, generated tokens included, so
the next turn of a chat (or the next step of an agent loop with a fixed system prompt) finds its
history already computed.

Reuse is exact: a warm reply is a cold one, bit for bit. On the CPU any shared token is reused
(`granule` 1): goinfer's attention kernels compute a query from its keys in an order fixed by
their positions, and every other kernel computes a row alone (compiler/kernels/attention.py), so
a token's KV and logits are the same whether it was prefilled in one chunk or another, or
decoded. The rest of the prompt resumes at the longest common prefix, the previous reply
included, as llama-server does. A cache on a GPU runs TVM's stock kernels, whose prefill result
depends on where a chunk began: there only tokens computed as whole chunks of a cold run's are
reused (`granule` = the chunk, `Seq.exact`), and the rest of the prompt runs in a cold run's
chunks against a cold run's KV. With `exact_only` False (--prefix-reuse longest) a GPU cache
reuses the whole shared prefix too, and its logits equal a cold run's to float rounding only.

A new prompt takes over the warm sequence sharing its longest reusable prefix and pops the tail
it does not share. Sequences are never forked from one another with TVM's fork: TVM attends a
forked sequence block by block and merges the parts, which is not the one-pass order above; the
choices of one prompt (`fork`) get a copy of its pages instead. At least the last
prompt token is always recomputed: its logits start the reply.

Warm sequences beyond `warm_limit`, and any needed to free pages, are dropped least recently used
first. All of this runs on the scheduler's thread only: the cache is not thread-safe.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import tvm_runtime as rt


@dataclass(eq=False)
class Seq:
    id: int
    tokens: list[int] = field(default_factory=list)  # what the cache holds for it, in order
    busy: bool = False  # a running request owns it
    last_used: float = 0.0
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:16])  # its file under --session-dir
    saved: int = 0  # tokens its session file holds
    exact: int = 0  # leading tokens computed as a cold run computes them: what may be reused


def common_prefix(a: list[int], b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != b[:n])
    return int(diff[0]) if diff.size else n


class KVPool:
    def __init__(
        self, kv, page_size: int, warm_limit: int, chunk: int, exact_only: bool = True, on_host: bool = True
    ):
        self.kv, self.page_size, self.chunk = kv, page_size, chunk
        # Checkpoints copy pages through host arrays: only a CPU cache's are taken (a GPU's
        # sessions keep their ids, and are re-prefilled when restored).
        self.on_host = on_host
        self.warm_limit, self.exact_only = warm_limit, exact_only
        # tokens are reusable one at a time with goinfer's CPU kernels, in whole chunks on a GPU
        self.granule = 1 if on_host else chunk
        self.seqs: dict[int, Seq] = {}
        self._ids = itertools.count(1)
        self.on_drop: Callable[[Seq], None] = lambda seq: None

    # -- reuse: the one rule of which tokens a later prompt may take over ---------------------------
    def reusable(self, seq: Seq, prompt: list[int] | np.ndarray) -> int:
        """How many of `prompt`'s leading tokens `seq` may lend it: never the last prompt token
        (its logits start the reply); in exact mode only those a cold run computes the same way
        (`Seq.exact`), in whole granules."""
        n = min(common_prefix(seq.tokens, np.asarray(prompt, np.int64)), len(prompt) - 1)
        if not self.exact_only:
            return n
        n = min(n, seq.exact)
        return n - n % self.granule

    def computed(self, seq: Seq, tokens: list[int]) -> None:
        """`tokens` were just computed onto `seq` in one forward. With granule 1 every token is a
        cold run's; otherwise only a whole chunk on a cold run's history (a decode step or a short
        chunk computes a token with other kernels or another split of its history)."""
        whole = self.granule == 1 or (len(tokens) == self.chunk and seq.exact % self.chunk == 0)
        if whole and seq.exact == len(seq.tokens):
            seq.exact += len(tokens)
        seq.tokens.extend(tokens)

    def acquire(self, prompt: list[int]) -> tuple[Seq, int]:
        """A sequence for `prompt`, owned by the caller, holding its first `reused` tokens."""
        want = np.asarray(prompt, np.int64)
        cands = [(self.reusable(s, want), s) for s in self.seqs.values() if not s.busy]
        best_len, best = max(cands, key=lambda c: c[0], default=(0, None))
        if best is None or best_len <= 0:
            return self.new(), 0
        rt.pop_tokens(self.kv, best.id, len(best.tokens) - best_len)
        del best.tokens[best_len:]
        exact = min(best.exact, best_len)
        best.busy, best.exact = True, exact - exact % self.granule
        return best, best_len

    def fork(self, seq: Seq) -> Seq | None:
        """A new owned sequence holding a copy of owned `seq`'s KV, page bytes copied (the choices
        of one prompt, OpenAI's `n`): a step on it is bit for bit a step on `seq`, which TVM's own
        fork, attending shared pages part by part, would not give. None where it cannot be made: a
        GPU cache, or no room for the copy (its pages and the copy's scratch page)."""
        if not self.on_host or not self.make_room(self.pages_for(Seq(-1), len(seq.tokens)) + 2):
            return None
        try:
            metadata, groups = rt.export_sequence(self.kv, seq.id)
            child = Seq(next(self._ids), list(seq.tokens), busy=True, exact=seq.exact)
            rt.import_sequence(self.kv, child.id, metadata, groups)
        except (RuntimeError, ValueError):  # a layout the copy does not know
            return None
        self.seqs[child.id] = child
        return child

    def pop(self, seq: Seq, n: int) -> None:
        """The last `n` tokens of an owned `seq` leave the cache (rejected drafts)."""
        rt.pop_tokens(self.kv, seq.id, n)
        del seq.tokens[len(seq.tokens) - n :]
        seq.exact = min(seq.exact, len(seq.tokens))

    def new(self) -> Seq:
        """An empty sequence, owned by the caller."""
        seq = Seq(next(self._ids), [], busy=True)
        rt.add_sequence(self.kv, seq.id)
        self.seqs[seq.id] = seq
        return seq

    def release(self, seq: Seq) -> None:
        """The owner is done: the sequence stays warm, unless reuse is off or it is over the limit."""
        seq.busy, seq.last_used = False, time.time()
        warm = sorted((s for s in self.seqs.values() if not s.busy), key=lambda s: s.last_used)
        for s in warm[: max(0, len(warm) - self.warm_limit)]:
            self.drop(s)

    def drop(self, seq: Seq, forget: bool = True) -> None:
        """Free `seq`; `forget` tells the session files it is gone (not when it was just saved)."""
        rt.remove_sequence(self.kv, seq.id)
        del self.seqs[seq.id]
        if forget:
            self.on_drop(seq)

    # -- checkpoints (sessions on disk) ------------------------------------------------------
    def export(self, seq: Seq) -> tuple[str, list] | None:
        """`seq`'s KV (tvm_runtime.export_sequence: the cache is left as it was), or None where it
        cannot be taken: a cache on a GPU, or no page for the copy's scratch sequence."""
        if not self.on_host:
            return None
        if self.free_pages() < 1:  # make one: the oldest other warm sequence goes, its ids file kept
            others = sorted(
                (q for q in self.seqs.values() if not q.busy and q is not seq), key=lambda q: q.last_used
            )
            if not others:
                return None
            self.drop(others[0], forget=False)
        try:
            return rt.export_sequence(self.kv, seq.id)
        except (RuntimeError, ValueError):  # a layout the copy does not know: the session keeps its ids
            return None

    def adopt_import(
        self, tokens: list[int], metadata: str, groups: list, key: str, last_used: float, exact: int
    ) -> Seq:
        """A warm sequence from an export, beside whatever the cache holds (bit for bit what was
        exported). Check it with `import_problem` first, and make room for its pages and one more;
        a refusal (ValueError) leaves the cache as it was."""
        if not self.on_host:
            raise ValueError("KV checkpoints are imported into a CPU cache only")
        seq = Seq(next(self._ids), list(tokens), last_used=last_used, key=key, saved=len(tokens), exact=exact)
        rt.import_sequence(self.kv, seq.id, metadata, groups)
        self.seqs[seq.id] = seq
        return seq

    def import_problem(self, tokens: list[int], metadata: str, groups: list, layout: dict) -> str | None:
        """Why a saved checkpoint cannot be imported into this cache, or None (checked without
        touching the cache: tvm_runtime.checkpoint_layers). `layout`: this model's num_layers,
        num_kv_heads, qk_head_dim and dtype."""
        try:
            meta = json.loads(metadata)
            if meta.get("seq_length") != len(tokens):
                return f"KV checkpoint of {meta.get('seq_length')!r} tokens beside {len(tokens)} ids"
            rt.checkpoint_layers(meta, groups, {**layout, "page_size": self.page_size})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"KV checkpoint does not fit this cache ({e})"
        return None

    def new_warm(self, key: str, last_used: float) -> Seq:
        """An empty sequence that a restored session's ids are fed into, then left warm."""
        seq = self.new()
        seq.key, seq.last_used = key, last_used
        return seq

    # -- pages -------------------------------------------------------------------------------
    def free_pages(self) -> int:
        return rt.available_pages(self.kv)

    def pages_for(self, seq: Seq, n: int) -> int:
        """Pages appending `n` tokens to `seq` may take: its partial last page fills first."""
        room = -len(seq.tokens) % self.page_size
        return max(0, -(-(n - room) // self.page_size))

    def make_room(self, pages: int) -> bool:
        """Drop warm sequences, least recently used first, until `pages` are free."""
        warm = sorted((s for s in self.seqs.values() if not s.busy), key=lambda s: s.last_used)
        while self.free_pages() < pages and warm:
            self.drop(warm.pop(0))
        return self.free_pages() >= pages

    @property
    def warm(self) -> int:
        return sum(not s.busy for s in self.seqs.values())
