"""`--drafter MODEL`: a small model with the target's tokenizer guesses the next tokens.

`DraftModel` is the small model with a paged cache of its own and warm sequences for prefix
reuse, as the target has (runtime/kv_pool.py). Each generation follows it with a
`ModelDrafter`: a sequence in that cache kept in step with the target's tokens. It is never
told what happened; before it drafts it compares what its cache holds with the tokens now
certain, pops what differs (drafts the target rejected, its own last guess) and feeds what it
lacks. So rejections, prefix reuse and preemption all come out right the same way.

Drafts are greedy: the small model's most likely tokens, while it gives them together at least
P_MIN odds of all being right (a guess it doubts costs a forward of its own and a verified
position, and is mostly wrong). A round that drafts nothing, or
whose first draft is rejected, rests the drafter: it sits out the next 1, 2, 4 .. MAX_REST rounds
and then takes their tokens in one forward, so text it cannot guess (prose, for a 0.5B drafting
for a 1.5B) costs a forward now and then, not one a token. Whatever it guesses, the target's
sampling decides every token (runtime/speculate.py): a drafter only changes speed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .kv_pool import KVPool, Seq, common_prefix

log = logging.getLogger("goinfer.runtime")

P_MIN = 0.5  # draft while the small model gives its drafts together at least these odds
FIRST_DRAFT, MAX_DRAFT = 3, 6  # tokens drafted a round: at first, at most
MAX_REST = 8  # rounds a drafter that guessed nothing sits out, at most (doubling from 1)


class DrafterMismatch(ValueError):
    """The drafter cannot draft for this model: its tokenizer is another."""


def vocabulary_problem(drafter, target) -> str | None:
    """Why `drafter` cannot draft for `target`, or None: every token id must mean the same text."""
    dv, tv = drafter.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dv == tv:
        return None
    differ = sum(1 for t, i in tv.items() if dv.get(t) != i)
    return (
        f"its vocabulary ({len(dv)} tokens) is not the model's ({len(tv)} tokens; {differ} differ): "
        "a drafter must share the model's tokenizer"
    )


class DraftModel:
    """The small model, its cache (`capacity` tokens) and its warm sequences."""

    def __init__(self, model, target, capacity: int, max_batch: int, warm: int, chunk: int):
        why = vocabulary_problem(model, target)
        if why is not None:
            raise DrafterMismatch(f"--drafter {Path(model.bundle.path).name}: {why}")
        self.model = model
        self.vocab = min(model.spec.vocab_size, target.spec.vocab_size)
        self.chunk = max(1, min(chunk, model.prefill_chunk))
        kv = model.create_cache(max(1, max_batch), capacity)
        self.pool = KVPool(kv, model.manifest.kv_cache.page_size, warm, self.chunk)

    def follow(self, tokens: list[int]) -> ModelDrafter:
        return ModelDrafter(self, tokens)


class ModelDrafter:
    """One generation's drafts from the small model (runtime/speculate.py's drafter interface)."""

    name = "drafter"

    def __init__(self, draft: DraftModel, tokens: list[int]):
        self.draft = draft
        self.tokens = list(tokens)  # certain: the prompt, then each token sampling picked
        self.seq: Seq | None = None
        self.agreed = 0  # leading tokens of the cache known to be certain ones (compared once)
        self.k = FIRST_DRAFT
        self.drafted = self.accepted = self.rounds = 0
        self.failed = False
        self.rest = self.resting = 0  # rounds to sit out after a miss; left of them now

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def catch_up(self, upto: int) -> None:
        """Feed the first `upto` certain tokens that the small model's cache lacks, a chunk at most."""
        self._sync(upto, self.draft.chunk)

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) greedy tokens after the certain ones; none while the cache is more
        than a chunk behind (it catches up a chunk a round instead: a step never waits longer)."""
        want = min(self.k, limit)
        if want <= 0 or self.failed:
            return []
        if self.resting:
            self.resting -= 1
            return []
        row = self._sync(len(self.tokens), self.draft.chunk)
        if row is None:
            return []
        drafts: list[int] = []
        sure = 1.0  # the small model's odds that every draft so far is right
        while True:
            token, p = self._top(row)
            sure *= p
            if sure < P_MIN:
                break
            drafts.append(token)
            if len(drafts) == want:
                break
            row = self._run([token])
            if row is None:
                break
        if not drafts:
            self._miss()
        return drafts

    def outcome(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.k = min(MAX_DRAFT, self.k + 1) if accepted == drafted else max(1, accepted + 1)
        if accepted:
            self.rest = 0
        else:
            self._miss()

    def _miss(self) -> None:
        self.rest = min(MAX_REST, max(1, 2 * self.rest))
        self.resting = self.rest

    def close(self) -> None:
        if self.seq is not None and self.seq.id in self.draft.pool.seqs:
            self.draft.pool.release(self.seq)
        self.seq = None

    # -- the small model's cache ----------------------------------------------------------
    def _sync(self, upto: int, most: int) -> np.ndarray | None:
        """Make the cache hold the first `upto` certain tokens, feeding at most `most`: the logits
        after the last certain token when `upto` is all of them and they are all in, else None."""
        pool, certain = self.draft.pool, self.tokens
        if not certain or self.failed:
            return None
        if self.seq is None or self.seq.id not in pool.seqs:
            self.seq, _ = pool.acquire(certain)  # the longest prefix a warm sequence holds
            self.agreed = 0
        held, at = self.seq.tokens, min(self.agreed, len(self.seq.tokens))
        keep = at + common_prefix(certain[at:], np.asarray(held[at:], np.int64))
        if upto == len(certain):  # the last certain token is fed: its logits start the drafts
            keep = min(keep, upto - 1)
        if keep < len(held):  # drafts sampling did not pick, and that last token
            pool.pop(self.seq, len(held) - keep)
        self.agreed = keep
        missing = certain[keep:upto]
        if not missing:
            return None
        if len(missing) > most:
            if self._run(missing[:most]) is not None:
                self.agreed += most
            return None
        row = self._run(missing)
        if row is not None:
            self.agreed += len(missing)
        return row if upto == len(certain) else None

    def _run(self, tokens: list[int]) -> np.ndarray | None:
        """Feed `tokens`: the logits after the last, or None (no room, or a failure: drafting stops
        for this generation, which goes on undrafted)."""
        pool, seq = self.draft.pool, self.seq
        if not pool.make_room(pool.pages_for(seq, len(tokens)) + 1):
            return None
        try:
            rows = self.draft.model.run(pool.kv, [seq.id], [tokens])
        except Exception as e:  # the target's tokens never depend on the drafter
            log.warning("drafter failed (%s); this generation goes on without it", e)
            self.failed = True
            return None
        pool.computed(seq, tokens)
        return rows[-1]

    def _top(self, row: np.ndarray) -> tuple[int, float]:
        """The small model's top token, and its probability."""
        row = row[: self.draft.vocab]
        top = int(np.argmax(row))
        return top, 1.0 / float(np.exp(row - row[top]).sum())


def load_drafter(path: str, target, capacity: int, config, chunk: int) -> DraftModel:
    """The --drafter bundle at `path`, ready to draft for `target`; a reason not to is one line
    (ValueError). Its self-test is skipped: a drafter changes how fast, never which tokens."""
    from goinfer.artifacts.giw import BundleError

    from .model import Model

    try:
        model = Model.load(path, self_test=False, device="cpu")
    except (BundleError, OSError) as e:
        raise DrafterMismatch(f"--drafter {path}: {e}") from None
    draft = DraftModel(model, target, capacity, config.max_concurrent, config.kv_sessions, chunk)
    log.info("--drafter %s drafts for %s", Path(path).name, target.bundle.path.name)
    return draft
