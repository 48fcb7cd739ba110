"""Budget-aware constrained decoding: close the output before max_tokens cuts it.

When a constrained request has few tokens left (max_tokens or context room), a
closing search (grammar/closing_search.py) finds a short token path to a state
where the output may end (the document is complete).
The first search runs PROBE_AT tokens before the end (at the start of a
shorter request); the path it finds sets how early the request's window opens,
so a document whose closing path is longer than the default window still
closes. The manager narrows the bitmask row to the path's next token once the
path needs (nearly) all the tokens left; a request whose search finds nothing is
not searched again. Every token of the path is one the matcher
accepted, so the output stays inside the grammar: budget-awareness never makes
an output invalid, it only turns cut ones into complete ones. Not a guarantee:
a search that finds no path within NODE_LIMIT, or free tokens that lengthen the
path past the slack, leave the request cut as before ("length", re-validation
says valid=false).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from formwork.grammar.backend import Matcher, set_only_tokens
from formwork.grammar.closing_search import ClosingSearch

SLACK = 2                # tokens of budget kept for what the next free token may add
# A pick that makes the closing path longer (opens a member, an element, a call) is
# refused, though a path fits after it, when fewer than ROOM tokens would be left to
# the model before steering writes that path: what it opened would come back as
# placeholders (`{"capital": "Mumbai", "": ""}`, a call with `"city": ""`).
ROOM = 2
# The searches run on the engine thread beside the forward and compete for its cores:
# measured at batch 32 (bench/structured_shapes.py 'flat'), window 32 / every 4 tokens
# cost 28 ms of fill per step (628 tok/s, 906 with budget-aware off); 16 / 8 cost
# 9.6 ms (785 tok/s) and still closed 50/50 outputs at max_tokens 24 (bench/budget_aware.py).
WINDOW = 16              # closing paths are searched in a request's last WINDOW tokens
SEARCH_EVERY = 8         # ... at least every SEARCH_EVERY tokens
# A document whose closing path is longer than the window cannot be closed from
# inside it (a 5-field object at max_tokens 32: a 33-token path, 0 of 50 closed). So
# a request is searched once when it has PROBE_AT tokens left (at its start if it
# has fewer), and its window opens at twice that path's length + EARLY_MARGIN: inside
# the window `guard` refuses a pick after which no path fits, but a record opened
# just before it may need more than the path had (a person's three fields after a
# 25-token path: the window at path + 8 opened one token after the `{"` that made
# the output uncloseable). That search is the request's first and counts as one
# (nothing found: GIVE_UP); a request that ends before PROBE_AT tokens are left never
# pays for it.
PROBE_AT = 64
EARLY_MARGIN = 8
# ... unless the document's shortest form is long: a request whose schema needs 73
# tokens from its start (an invoice: seven required fields, a line item) wrote one
# string for 440 tokens of its 512, and from there 67 were needed, more than the 64
# left at the probe: it gave up and was cut. So at a request's first step the path
# from the start is searched (once per constraint: every request of a schema starts in
# the same state; at most START_LIMIT tokens) and the probe runs at twice its length +
# EARLY_MARGIN before the end if that is earlier.
START_LIMIT = 256
# GIVE_UP: a request whose search found no path is not searched again. Measured with
# SmolLM2 at temperature 0.7 (50 requests each: bench/budget_aware.py's schema at 24,
# 32 and 40 tokens, bench/soak.py's 60-property storm schemas at 24, a nested schema
# at 20): 105 requests had a search that found nothing, 80 of them searched again
# later, none found a path; each such search costs a failing search's full price
# (~1.7 ms on the engine thread, and a storm's 64 requests reach it in one step).
# One more search 16 tokens after a failed one was tried (2026-12-06):
# on 120 corpus schemas at max_tokens 64 it closed no more outputs (7 cut either
# way; the case it was for, a probe stuck where only whole key names are allowed,
# is solved in the search), and on bench/structured_overhead.py (no output can
# close) it added ~0.5-1 ms of fill per step at batch 32. Not kept.


@dataclass(slots=True)
class Budget:
    """One request's budget-aware state (owned by the StructuredOutputManager)."""
    left: int                           # tokens it may still append
    key: str | None = None              # the constraint's cache key (its start path is shared)
    probe_at: int | None = None         # `left` at which the probe runs (set at the first step)
    closing: list[int] | None = None    # a closing path from the current state, if known
    closing_len: int = 0                # length of the last path found (0: none)
    searched_at: int | None = None      # `left` at the last search
    gave_up: bool = False               # a search found no path: never searched again
    window: int = WINDOW                # searched when due once `left` is at most this
    probed: bool = False                # the PROBE_AT search was done
    closed_early: bool = False          # a bitmask row was narrowed to close it
    # (token, the closing path after it): a pick `guard` let through, its path found
    pending: tuple[int, list[int]] | None = None

    def spend(self, token_ids: list[int]) -> None:
        """Accepted tokens; the closing path stays known while they follow it."""
        self.left -= len(token_ids)
        pending, self.pending = self.pending, None
        if pending is not None and list(token_ids) == [pending[0]]:
            self.found(pending[1])
            return
        path = self.closing
        follows = path is not None and path[:len(token_ids)] == list(token_ids)
        self.closing = path[len(token_ids):] if follows else None

    def found(self, path: list[int] | None) -> None:
        """A search from the current state found `path` (None: nothing)."""
        self.closing, self.closing_len = path, len(path) if path else 0
        self.searched_at = self.left

    def search_due(self) -> bool:
        """Search now: first time in the window, every SEARCH_EVERY tokens (free tokens
        may lengthen the path), and each step once the last path nearly fills it;
        never again after a search that found no path (GIVE_UP)."""
        if self.gave_up:
            return False
        return (self.searched_at is None or self.searched_at - self.left >= SEARCH_EVERY
                or 0 < self.closing_len and self.left <= self.closing_len + SLACK + SEARCH_EVERY)


def forced_next(search: ClosingSearch, budget: Budget, matcher: Matcher) -> int | None:
    """The closing path's next token once the path needs (nearly) all the tokens
    left, else None. Searches when due (so a second call in a step does not)."""
    if budget.probe_at is None:           # the request's first step: nothing accepted yet
        budget.probe_at = _probe_point(search, budget, matcher)
    # The probe also runs at the start of a request inside its window: the guard
    # runs from the probe on.
    if not budget.probed and budget.left <= budget.probe_at:
        _probe(search, budget, matcher)
    if budget.left > budget.window:
        return None
    if budget.closing is None and budget.search_due():
        budget.found(search.path(matcher, budget.left))
        budget.gave_up = budget.closing is None
    if not budget.closing or len(budget.closing) + SLACK < budget.left:
        return None
    return budget.closing[0]


def _probe_point(search: ClosingSearch, budget: Budget, matcher: Matcher) -> int:
    """PROBE_AT, or twice the length of the document's shortest form (the path from
    the start, remembered per constraint) + EARLY_MARGIN where that is more."""
    if budget.left <= PROBE_AT or budget.key is None:
        return PROBE_AT                   # probed at once anyway
    n = search.start_length(budget.key, matcher, START_LIMIT)
    return PROBE_AT if n is None else max(PROBE_AT, 2 * n + EARLY_MARGIN)


def _probe(search: ClosingSearch, budget: Budget, matcher: Matcher) -> None:
    """The request's first search (`probe_at` tokens before the end, or at its start
    if it has fewer): where its window opens."""
    budget.probed = True
    path = search.path(matcher, budget.left)
    budget.found(path)
    budget.gave_up = path is None
    if path is not None:
        budget.window = max(WINDOW, 2 * len(path) + EARLY_MARGIN)


def steer(search: ClosingSearch, budget: Budget, matcher: Matcher, bitmask: torch.Tensor,
          row: int) -> bool:
    """Narrow `bitmask[row]` to `forced_next`'s token; True if it did."""
    token = forced_next(search, budget, matcher)
    if token is None:
        return False
    set_only_tokens(bitmask, row, [token])
    budget.closed_early = True
    return True


def guard(search: ClosingSearch, budget: Budget, matcher: Matcher, token_id: int) -> int | None:
    """The closing path's next token in place of a sampled `token_id` after which no
    closing path fits in the tokens left, or which opens what only the path's
    placeholders would fill (ROOM); None to keep the pick.

    SLACK covers a free token that lengthens the path by a token or two (string
    content, a digit), not one that opens a structure: `},` in a list of records with
    12 tokens left starts an element whose required fields need 14 more, and the
    output was cut (4 of 6 chats at max_tokens 40 on such a schema). So from the
    probe on (`probe_at` tokens before the end; only inside the window, a probe's tiny
    path let the model open, before the window, what then could not close) every pick
    that leaves the known path is tried on the matcher: if the known path still closes
    the output from there (string content, a digit: the common case,
    `Matcher.closes_with`, ~2 us on llguidance), it is kept; else the new state is
    searched, its first dive only (`any_path`: whether a path fits, not the shortest),
    and a pick with no path in the tokens left, or one that lengthens the path and
    leaves the model fewer than ROOM tokens of its own, is replaced by the first token
    of the shortest path from before it. The path kept or found serves the next step (no
    second search). A search that misses an existing path only closes the output a
    little sooner."""
    if budget.gave_up or not budget.probed:
        return None
    path = budget.closing
    if path and token_id == path[0] or token_id == search.eos:   # eos: allowed, so it may end
        return None
    if path is not None and len(path) < budget.left and \
            matcher.closes_with([token_id, *path], search.eos):
        budget.pending = (token_id, path)     # the known path still closes it from there
        return None
    if not matcher.accept_tokens([token_id]):
        return None                 # refused: the caller's accept reports it
    try:
        after = search.path(matcher, budget.left - 1, any_path=True)
    finally:
        matcher.rollback(1)
    if after is not None and (path is None or len(after) <= len(path) or len(path) > budget.left
                              or budget.left - 1 - len(after) - SLACK >= ROOM):
        budget.pending = (token_id, after)
        return None
    # Refused: no path fits after it, or it opens what only the path's placeholders
    # would fill (a new member or element, a call's trigger) and the output closes
    # where it is instead. The known path may be one a pick kept without a search (`com` after
    # `example.`, whose path began with `0`): search here for the shortest, which
    # the replacement starts (its first token, not the stale path's `0` that let an
    # email grow `0000012345` while the model kept asking to close it).
    fresh = search.path(matcher, budget.left)
    budget.searched_at = budget.left
    if fresh is not None or path is None:     # else the known path stays
        path = fresh
        budget.found(path)
    if path is None:
        budget.gave_up = True
        return None
    closer = path[0] if path else search.eos      # [] : the output may end here
    if closer is not None:
        budget.closed_early = True
    return closer
