"""The closing search of budget-aware decoding (grammar/budget.py): a short token
path from a matcher's state to one where the output may end.

A first dive (the first closing token the matcher accepts at every state, string
content followed where none is) and then a bounded depth-first search over the
matcher. The search expands only "closing" tokens (`"}`, `"`, `}`, `]`, `0`,
`""`, ...) and, where none is allowed, single-byte tokens, at most MAX_BRANCH per
state, each followed by the text the grammar then forces (a key name), tokenized
as jump-forward does; biggest closing steps first; a token that leads back to its
state's mask (string content) is not followed, so the search moves towards the
end instead of writing. The path is short, not always the shortest. Every token
of it is one the matcher accepted; the matcher's state is unchanged afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from formwork.grammar.backend import Matcher
from formwork.grammar.jump_forward import ForcedTextEncoder, forced_tokens
from formwork.grammar.vocab import TokenVocab, first_id_by_bytes

# Closing texts, best first: they end strings, objects and arrays, or are the
# shortest values ("0", '""', "null") of their type; "{" / "[" open a required one.
CLOSERS = ('""}', '""', '"}', '"]', '","', '":""', '"', '",', '":', '}', ']', ',"', '0',
           'null', 'true', ',', ':', '[]', '{}', '{', '[', '}]', ']}', '}}', 'Z')
# A second order (string content before empty strings): which is shorter depends
# on the tokenizer's merges, so both are searched and the shorter path is kept.
CLOSERS_ALT = ('"}', '"]', '","', '":""', '""}', '""', '"', '",', '":', '}', ']', ',"', '0',
               'null', 'true', ',', ':', '[]', '{}', '{', '[', '}]', ']}', '}}', 'Z')
# ',"' (the next key's quote) comes after '}' and ']': where an object or an array may
# end, a dive that takes it first goes on adding members (an open object's `"":""`).
# 'Z' is last: it ends a date-time's or a time's seconds, where '0' (fractional digits)
# is the only other closer allowed and the dive would otherwise write zeros for ever.
MAX_BRANCH = 6           # candidates expanded per state, in CLOSERS order
# States evaluated per search and closer order (bounds the cost of one step). 96 -> 32
# closed exactly the same outputs (bench/budget_aware.py at 24/32/40 tokens: 50/48/50 of
# 50; six schema shapes at 20 and 32 tokens: 168/288 both) while a search that finds
# nothing, the common case once a document cannot close in time, costs a third.
NODE_LIMIT = 32
# A search whose first dive (the first closer at every state, no depth limit) has
# not ended after HOPELESS x the tokens left is not run: measured on 4,468 searches
# (bench/budget_aware.py's shapes at 12-96 tokens, storm schemas; temperature 0.7),
# 120 such dives, none where the full search found a path (1.5: 240, none; 1: 64 of
# 394 found one). It costs a few states instead of 64 (~1 ms instead of ~7 for a
# 60-property storm schema). That dive stopped (and the full search ran) at the first
# state whose mask repeated the last one: string content, but also `}` after `}`, a
# digit after a digit. The dive now asks the matcher token by token, follows string
# content and keeps its path when it ends: the probe's failing searches on
# bench/structured_shapes.py cost 2-4x less (nested 10 -> 2 ms a request, pattern
# the same), and bench/budget_aware.py --shapes closes 663 of 900 outputs instead
# of 647 (a ten-field record and a pattern-and-minLength record at 96 tokens: 12 -> 20).
# With this dive, uncut, on that run's 3,203 searches: of the dives that ended after
# 1.5-2x the tokens left (40) or later (82), none led to a path; of those ending
# after 1-1.5x, 48 of 168 did. So 1.5 (a hopeless dive a quarter shorter).
HOPELESS = 1.5
ENDS, LONG, STUCK = "ends", "long", "stuck"     # how a first dive ended
CONTENT_KEPT = 4         # content bytes a dive tries again before asking for a mask
# A dive whose tokens have come from the same two (one token, or two alternating) this
# many times running asks the mask once for a single byte outside them: `[0-9]+[a-z]`
# after digits ends only with a letter, which no closer is; an email's local part takes
# '}' and '0' by turns (both are closers) and ends only with '@'. Counted digits
# (`[0-9]{4}`) stay under it.
REPEATS = 4
# That byte, best first: a separator that moves a format on to its next part ('@'
# after an email's local part, ':' after a uri's scheme), then a byte of a kind (digit
# / letter / other) the run did not take ('Z' or '+' after fractional seconds), then
# the rest; vocabulary order within each.
SEPARATORS = b"@:"


def _kind(b: bytes) -> int:
    return 0 if b.isdigit() else 1 if b.isalpha() else 2


def _allowed(words: list[int], ids: list[int]) -> list[int]:
    """The tokens of `ids` a mask (its words as ints) allows, in order."""
    return [t for t in ids if (words[t >> 5] >> (t & 31)) & 1]


def _last_to_end(tokens: list[int], last: int | None) -> list[int]:
    """`tokens` with `last` (if among them) moved to the end."""
    if last is None or last not in tokens:
        return tokens
    return [t for t in tokens if t != last] + [last]


@dataclass(slots=True)
class _Node:
    """Where a search step leads: the tokens it accepts (a closer, then forced text),
    whether the output may end there, and that state's mask (filled when needed)."""
    step: list[int]
    ends: bool
    mask: tuple[bytes, list[int]] | None = None


class ClosingSearch:
    """Finds short accepting paths for matchers of one vocabulary (engine thread)."""

    def __init__(self, vocab: TokenVocab, vocab_size: int, eos_token_id: int | None,
                 encoder: ForcedTextEncoder):
        self._encoder = encoder     # forced text, tokenized as jump-forward does
        by_bytes = first_id_by_bytes(vocab.token_bytes[:vocab_size])
        self.orders = [[by_bytes[c.encode()] for c in order if c.encode() in by_bytes]
                       for order in (CLOSERS, CLOSERS_ALT)]
        singles = sorted((b, t) for b, t in by_bytes.items() if len(b) == 1)
        # whitespace last: it is never what completes an output soonest
        self.single = [t for b, t in singles if not b.isspace()] + \
            [t for b, t in singles if b.isspace()]
        self.eos = eos_token_id
        self._bytes = {t: b for b, t in singles}
        self._digits = [t for b, t in singles if b.isdigit()]
        self._token_bytes = vocab.token_bytes
        self._len = [len(b) if b is not None else 1 << 20 for b in vocab.token_bytes[:vocab_size]]
        self._row = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
        self._start: dict[str, int | None] = {}    # start_length's, by constraint key

    def start_length(self, key: str, matcher: Matcher, limit: int) -> int | None:
        """The length of a path from `matcher`'s state, which is the start of the
        constraint `key`: its first dive (an estimate, as `any_path`: 1-5 ms where the
        full search took 10-20 for 60-property schemas), once per key (bounded: emptied
        at 4,096 keys)."""
        if key not in self._start:
            if len(self._start) >= 4096:
                self._start.clear()
            path = self.path(matcher, limit, any_path=True)
            self._start[key] = None if path is None else len(path)
        return self._start[key]

    def can_end(self, matcher: Matcher) -> bool:
        """Whether the output may end here (the eos token is accepted); state unchanged."""
        if matcher.is_terminated():
            return True
        # `accepts`: llguidance answers from its state (~1 us); accepting the eos token
        # and rolling it back took ~0.1 ms there
        return self.eos is not None and matcher.accepts(self.eos)

    def _mask(self, matcher: Matcher) -> tuple[bytes, list[int]]:
        """(the mask's bytes, its words as ints) of `matcher`'s state."""
        matcher.fill_bitmask(self._row, 0)
        words = self._row[0].numpy()
        return words.tobytes(), words.tolist()

    def _candidates(self, words: list[int], closers: list[int]) -> list[int]:
        found = _allowed(words, closers) or _allowed(words, self.single) or self._shortest(words)
        return found[:MAX_BRANCH]

    def _shortest(self, words: list[int]) -> list[int]:
        """Where neither a closer nor a single byte is allowed, the allowed tokens, the
        shortest first: llguidance may allow a key's names only as whole tokens
        (`formClasses` / `formId` after `,"`), and the dive stopped there (STUCK)."""
        ids = [w * 32 + b for w, word in enumerate(words) if word
               for b in range(32) if (word >> b) & 1]
        return sorted((t for t in ids if t < len(self._len) and t != self.eos),
                      key=lambda t: (self._len[t], t))

    def path(self, matcher: Matcher, limit: int, *, any_path: bool = False) -> list[int] | None:
        """Tokens (at most `limit`) that lead `matcher` to a state where the output may
        end; None if none is found (or the first dive says none will be: HOPELESS).
        In each closer order: its first dive, then a search for a shorter path; each
        path found is respelled in the tokenizer's own tokens (`_respelled`; the forced
        text before it is already) and the shortest that fits is kept. The matcher's state is unchanged.
        Text the grammar forces from here (a key name after its opening quote, where
        the only token allowed may be the whole name: no closer, no single byte) is
        the path's start, as every step's forced text is. `any_path`: the first
        dive's path when it fits (no search for a shorter one): whether a path exists,
        for budget.guard, at a dive's cost."""
        if self.can_end(matcher):
            return []
        lead = forced_tokens(matcher, self._encoder)
        try:
            rest = (self._path(matcher, limit - len(lead), any_path) if len(lead) <= limit
                    else None)
        finally:
            matcher.rollback(len(lead))
        return None if rest is None else lead + rest

    def _respelled(self, matcher: Matcher, path: list[int]) -> list[int]:
        """`path`'s text in the tokenizer's own tokens where they are fewer and close
        the output as well. The search builds its path from closers, single bytes and
        forced names, so its text comes in more pieces than the tokenizer's merges make
        of it (`{` `"` `name` `"` `:` `"` against `{"` `name` `":"`): a tool call's
        path from its start was 29 tokens, spelled 21. The path's length decides
        whether the output can close and when it is steered onto the path, and the
        path is then what the output is written in: a call that fit in its 32 tokens
        was steered from its second token on and left no room for an argument
        (`"city": "}"`), one at 24 tokens was left cut. Costs a tokenizer call (~50 us)
        and the matcher's check, per path found."""
        if len(path) < 2:
            return path
        try:
            text = b"".join(self._token_bytes[t] for t in path).decode("utf-8")
        except UnicodeDecodeError:            # a character split across the path's end
            return path
        ids = self._encoder.spelled(text)
        if not ids or len(ids) >= len(path) or not matcher.closes_with(ids, self.eos):
            return path
        return list(ids)

    def _path(self, matcher: Matcher, limit: int, any_path: bool = False) -> list[int] | None:
        if self.can_end(matcher):
            return []
        # Paths are built in the search's own tokens and judged respelled, which takes
        # fewer: the dives and searches may run up to HOPELESS x `limit` of them.
        loose = int(HOPELESS * limit)
        nodes: dict[tuple[int, ...], _Node | None] = {}    # shared by the dives and searches
        found = []

        def keep(p: list[int]) -> bool:
            spelled = self._respelled(matcher, p)
            if len(spelled) <= limit:
                found.append(spelled)
            return len(spelled) <= limit

        for k, order in enumerate(self.orders):
            dive, verdict = self._dive(matcher, loose, order, nodes)
            if verdict == LONG and k == 0:
                return None
            depth = loose
            if verdict == ENDS and len(dive) <= loose:
                if keep(list(dive)) and any_path:
                    return found[0]
                depth = len(dive) - 1
            if (p := self._search(matcher, depth, order, nodes)) is not None:
                keep(p)
        return min(found, key=len) if found else None

    def _dive(self, matcher: Matcher, cap: int, closers: list[int],
              nodes: dict) -> tuple[tuple[int, ...], str]:
        """Follow the first of `closers` the matcher accepts at every state (what the
        depth-first search tries first): (its path, ENDS) when the output may end
        there, (path, LONG) when it has not after `cap` tokens, (path, STUCK) when
        neither a closer nor a single-byte token is allowed. Closers are asked one by
        one (`accepts`: ~1 us each, a mask ~0.1 ms); the token just accepted is asked
        last (an integer would take '0' for ever). Where no closer is allowed, one of
        the last CONTENT_KEPT content bytes if allowed, else the mask's first single
        byte (a pattern's item costs a mask per kind of character once): string
        content (a minLength, a `[0-9]{4}`: the same mask while it progresses) is
        followed, so a dive's path also closes such strings, which the search's
        same-mask rule cannot. Its states are remembered for the search."""
        path: tuple[int, ...] = ()
        node = self._root(nodes)
        last = None              # the last token
        recent: list[int] = []   # the last two tokens
        content: list[int] = []  # the last few content (single-byte) picks, latest first
        repeats = 0              # tokens taken running from `recent`
        try:
            while True:
                tid = next((t for t in _last_to_end(closers, last) if matcher.accepts(t)), None)
                if tid is None:              # string content goes on: no mask
                    tid = next((t for t in content if matcher.accepts(t)), None)
                if tid is None:              # no closer: the first allowed single byte
                    singles = self._candidates(self._mask_of(node, matcher)[1], [])
                    tid = singles[0] if singles else None
                if tid in self._digits and (d := self._ending_digit(matcher, closers)) is not None:
                    tid = d                  # a number's last digit may be what ends it
                repeats = repeats + 1 if tid is not None and tid in recent else 0
                if repeats == REPEATS:       # once per run
                    tid = self._other_kind(node, matcher, tid, {tid, *recent})
                if tid is not None and tid not in closers:
                    content = [tid] + [t for t in content if t != tid][:CONTENT_KEPT - 1]
                step = None if tid is None else self._expand(matcher, path, tid, nodes)
                if step is None:
                    return path, STUCK
                last = step.step[-1]
                recent = [tid, *recent][:2]
                node, path = step, path + tuple(step.step)
                if node.ends:
                    return path, ENDS
                if len(path) > cap:
                    return path, LONG
        finally:
            matcher.rollback(len(path))

    def _ending_digit(self, matcher: Matcher, closers: list[int]) -> int | None:
        """A digit after which the number may end (the output may, or a closer that
        is not a digit is accepted), if any: under `multipleOf: 7` the closers' '0'
        after `123` only multiplies by ten and never reaches a multiple, while one
        digit always does (10n + d covers every residue). Asks the matcher (~10
        accepts, no mask); its state is unchanged."""
        enders = [t for t in closers if t not in self._digits]
        for d in self._digits:
            if not matcher.accept_tokens([d]):
                continue
            try:
                if self.can_end(matcher) or any(matcher.accepts(t) for t in enders):
                    return d
            finally:
                matcher.rollback(1)
        return None

    def _other_kind(self, node: _Node, matcher: Matcher, tid: int, run: set[int]) -> int:
        """A single byte `node`'s mask allows that is not in `run` (the tokens of a
        run): a SEPARATORS byte first, then one of a kind no single byte of the run
        is, then any (whitespace last); else `tid`."""
        kinds = {_kind(self._bytes[t]) for t in run if t in self._bytes}
        others = [t for t in _allowed(self._mask_of(node, matcher)[1], self.single)
                  if t not in run]

        def rank(t: int) -> tuple[int, int]:
            b = self._bytes[t]
            sep = SEPARATORS.find(b)
            return (0, sep) if sep >= 0 else (1, 0) if _kind(b) not in kinds else (2, 0)
        return min(others, key=rank, default=tid)

    def _expand(self, matcher: Matcher, path: tuple[int, ...], tid: int,
                nodes: dict) -> "_Node | None":
        """Accept `tid` (after `path`) and what the grammar then forces; None (matcher
        unchanged) if refused. Both closer orders reach many of the same paths: what a
        path leads to is remembered, so the second order only re-accepts its tokens
        instead of asking for forced text and a mask again (same result, a fraction
        of the cost: a failing search is what a request that cannot close runs)."""
        key = path + (tid,)
        if key in nodes:
            node = nodes[key]
            if node is not None:
                ok = matcher.accept_tokens(node.step)
                assert ok, "a remembered closing step was refused"
            return node
        if not matcher.accept_tokens([tid]):
            nodes[key] = None
            return None
        step = [tid]
        if not self.can_end(matcher):       # then what the grammar forces (a key)
            step += forced_tokens(matcher, self._encoder)
        node = nodes[key] = _Node(step, self.can_end(matcher))
        return node

    def _search(self, matcher: Matcher, limit: int, closers: list[int],
                nodes: dict) -> list[int] | None:
        """Depth-first, closers in the given order, at most NODE_LIMIT evaluated
        states; a token that leads back to its state's mask (string content) is not
        followed."""
        evaluated = 0

        def dfs(path: tuple[int, ...], sig: bytes, words: list[int],
                depth: int) -> list[int] | None:
            nonlocal evaluated
            for tid in self._candidates(words, closers):
                if evaluated >= NODE_LIMIT:
                    return None
                node = self._expand(matcher, path, tid, nodes)
                if node is None:
                    continue
                evaluated += 1
                step, rest = node.step, None
                try:
                    if len(step) <= depth and node.ends:
                        return list(step)
                    if len(step) < depth:
                        mask = self._mask_of(node, matcher)
                        if mask[0] != sig:
                            rest = dfs(path + tuple(step), *mask, depth - len(step))
                finally:
                    matcher.rollback(len(step))
                if rest is not None:
                    return step + rest
            return None

        if limit <= 0:
            return None
        return dfs((), *self._mask_of(self._root(nodes), matcher), limit)

    @staticmethod
    def _root(nodes: dict) -> _Node:
        """The search's starting state, shared by the dive and both orders."""
        root = nodes.get(())
        if root is None:
            root = nodes[()] = _Node([], False)
        return root

    def _mask_of(self, node: _Node, matcher: Matcher) -> tuple[bytes, list[int]]:
        """`node`'s mask (`matcher` is in its state), filled once."""
        if node.mask is None:
            node.mask = self._mask(matcher)
        return node.mask
