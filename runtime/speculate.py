"""Speculative decoding: guesses at the next tokens, fed beside the certain one and checked by
sampling (`--spec ngram`, `--drafter MODEL`).

Agents copy most of a file back when they edit it, so the next tokens are often already in the
sequence. `NgramDrafter` finds the latest earlier occurrence of the sequence's last n tokens (n
from MAX_N down to MIN_N) and proposes the tokens that followed it. Its index maps each n-gram
to where its latest occurrence ended, and grows by one entry per n with each token: no rescan.

The scheduler feeds a step's token and the drafts in one forward, hands the generation the
logits after its token, and keeps the logits after each draft. The generation samples as it
always does; when what it samples is the next draft, those logits are already there and no
forward runs. Drafts are only guesses at what sampling will pick, never tokens emitted on their
own, so the output is plain decoding's, byte for byte, greedy or sampled, grammar or not: a
forward's rows are the logits a single-token step gives, bit for bit (runtime/kv_pool.py). A
draft the generation did not pick is popped from the cache.

Sampled drafts are the standard speculative-sampling rule for a drafter that proposes one token
(q a point mass): a draft is accepted with probability min(1, p/q) = p(draft), and a rejection
resamples from p with the draft removed. Sampling from p and comparing is that rule, drawn from
the request's own seeded stream, so the tokens are plain decoding's, not only their distribution.

How many tokens to draft adapts: after a round whose drafts were all taken, two more (up to
MAX_DRAFT); otherwise one more than were taken. No match, no draft: prose costs nothing.
`--drafter` (runtime/draft_model.py) drafts with a small model instead, or after the n-grams
when both are on: what the text does not repeat, the small model may still guess.
"""

from __future__ import annotations

MIN_N, MAX_N = 2, 4  # n-gram lengths matched, longest first
FIRST_DRAFT, MAX_DRAFT = 4, 8  # tokens drafted a step: at first, at most


class NgramDrafter:
    name = "ngram"

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_N, MAX_N + 1)}
        self.k = FIRST_DRAFT
        self.drafted = self.accepted = self.rounds = 0  # over the generation, for its log line
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens now certain (the prompt, then each generated one)."""
        for t in tokens:
            # the n-grams ending at the current end become "earlier" once t follows them
            end = len(self.tokens)
            for n in self.ends:
                if end >= n:
                    self.ends[n][tuple(self.tokens[end - n : end])] = end
            self.tokens.append(t)

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the longest earlier match of the sequence's end."""
        want = min(self.k, limit)
        if want <= 0:
            return []
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(self.tokens) < n:
                continue
            end = self.ends[n].get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end : end + want]
        return []

    def outcome(self, drafted: int, accepted: int) -> None:
        """A round's result: `accepted` of its `drafted` tokens were what sampling picked."""
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.k = min(MAX_DRAFT, self.k + 2) if accepted == drafted else max(1, accepted + 1)

    def catch_up(self, upto: int) -> None:
        """(no cache of its own)"""

    def close(self) -> None:
        """(nothing held)"""


class Lookahead:
    """One generation's speculation: its drafters, tried in order (the first that proposes
    drafts a round), and the drafts fed past its last sampled token with the logits after each.
    The caller owns the cache: `feed` says what to feed, `dropped` how many tokens to pop."""

    def __init__(self, drafters: list):
        self.drafters = drafters  # NgramDrafter, draft_model.ModelDrafter: extend/propose/outcome
        self.by = None  # the drafter of the drafts ahead
        self.ahead: list[int] = []
        self.rows: list = []
        self.drafted = 0

    def take(self, token: int):
        """The logits after `token` when it is the next draft (no forward needed), else None."""
        if not self.ahead or token != self.ahead[0]:
            return None
        self.ahead.pop(0)
        for d in self.drafters:
            d.extend([token])
        if not self.ahead:
            self.by.outcome(self.drafted, self.drafted)
        return self.rows.pop(0)

    def dropped(self) -> int:
        """Sampling picked another token than the next draft: how many drafts leave the cache."""
        n = len(self.ahead)
        if n:
            self.by.outcome(self.drafted, self.drafted - n)
            self.ahead, self.rows = [], []
        return n

    def feed(self, token: int, limit: int) -> list[int]:
        """`token` is certain: it and up to `limit` drafts to feed in one forward."""
        for d in self.drafters:
            d.extend([token])
        for d in self.drafters:
            drafts = d.propose(min(limit, MAX_DRAFT))
            if drafts:
                self.by = d
                return [token, *drafts]
        return [token]

    def fed(self, feed: list[int], rows) -> None:
        """The forward ran: `rows` are the logits after each fed token."""
        self.ahead, self.rows, self.drafted = feed[1:], list(rows[1:]), len(feed) - 1

    def catch_up(self, upto: int) -> None:
        """The first `upto` tokens are in the target's cache (a prompt chunk): a drafter with a
        cache of its own follows, a chunk at a time, so its prompt is fed beside the target's."""
        for d in self.drafters:
            d.catch_up(upto)

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    def log_line(self) -> str:
        ds = self.drafters
        line = (
            f"speculation: {sum(d.drafted for d in ds)} tokens drafted, {sum(d.accepted for d in ds)} "
            f"accepted in {sum(d.rounds for d in ds)} rounds"
        )
        if len(ds) > 1:
            line += " (" + ", ".join(f"{d.name} {d.accepted}/{d.drafted}" for d in ds) + ")"
        return line
