"""No UTF-16 surrogate escapes (`\\uD800`-`\\uDFFF`) in JSON that xgrammar generates.

RFC 8259's grammar lets a string hold any `\\uXXXX`, so xgrammar's JSON strings
took `"\\ud800"` and `"a\\udc00b"`: a lone surrogate. Python's `json` decodes it
into a str that cannot be encoded as UTF-8, and pydantic's parser (what
instructor and pydantic-ai validate with) refuses the text ("unexpected end of
hex escape"): an output one client reads and another rejects. llguidance and
outlines-core write `\\u` only for control characters. For JSON-producing
constraints this guard refuses, in the mask and in `accept_tokens`, every token
that would write `\\u` followed by `D8`-`DF` (any case) as an escape; a character
beyond the BMP is written as itself (raw UTF-8, which JSON allows) instead of as
an escaped pair: stricter, never wrong.

It follows the bytes as a small automaton that knows whether a backslash starts
an escape (`\\\\ud800` is an escaped backslash, then text): states 0 (plain), 1 (an
escape's backslash), 2 (`\\u`), 3 (`\\uD`). Per state, a bitmask row of the tokens
allowed and, per token, the state it leads to; built once per vocabulary.
Between JSON values there is no backslash, so the automaton is exact wherever
it reads JSON; in a structural tag's free text it also refuses the same six
bytes, which no prose needs.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from formwork.grammar.utf8_guard import INVALID, ByteGuard
from formwork.grammar.vocab import TokenVocab

_STATES = 4
_SURROGATE_SECOND = frozenset(b"89abcdefABCDEF")


def advance(state: int, data: bytes) -> int:
    """The automaton's state after `data` from `state`, INVALID at a surrogate escape."""
    i = 0
    while i < len(data):
        if state == 0:
            i = data.find(b"\\", i)            # plain text up to the next backslash
            if i < 0:
                return 0
            state = 1
        elif state == 1:
            state = 2 if data[i] == 0x75 else 0         # \u, or a complete escape
        elif state == 2:
            state = 3 if data[i] in (0x44, 0x64) else 0  # \uD / \ud
        else:
            if data[i] in _SURROGATE_SECOND:
                return INVALID
            state = 0
        i += 1
    return state


class SurrogateEscapeGuard(ByteGuard):
    """Per vocabulary: allowed-token rows and next states for each automaton state."""

    def __init__(self, vocab: TokenVocab):
        n = vocab.vocab_size
        words = (n + 31) // 32
        # numpy, not torch, for the same reason as utf8_guard (no OpenMP region here)
        allowed = np.ones((_STATES, words * 32), dtype=bool)
        # a token without bytes (special, padding) leaves the state as it is
        self.next = np.repeat(np.arange(_STATES, dtype=np.int8)[:, None], n, axis=1)
        for tid, data in enumerate(vocab.token_bytes[:n]):
            if not data:                        # the grammar decides about special tokens
                continue
            for s in range(_STATES):
                end = advance(s, data)
                self.next[s, tid] = end
                allowed[s, tid] = end != INVALID
        self.rows = torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))
        self.state0_refuses = not bool(allowed[0, :n].all())

    def step(self, state: int, token_ids: Sequence[int]) -> int:
        """The state after `token_ids`, INVALID if any of them is refused."""
        for tid in token_ids:
            tid = int(tid)
            state = int(self.next[state, tid]) if 0 <= tid < self.next.shape[1] else state
            if state == INVALID:
                return INVALID
        return state
