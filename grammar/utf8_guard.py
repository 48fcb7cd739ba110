"""Well-formed UTF-8 across tokens, for a backend whose grammar reads bytes loosely.

xgrammar 0.2.x accepts a lead byte followed by any continuation bytes: UTF-16
surrogates written in UTF-8 (ED A0 80) wherever its grammar has `.` or a negated
class (a regex's `.`, a JSON string), and overlong forms (E0 80 80) in the
character classes of length-bounded strings. Such bytes decode to U+FFFD per byte,
so `a.b` produced "a\ufffd\ufffd\ufffdb" and a maxLength could be exceeded.
llguidance refuses both. This guard follows the bytes a matcher has accepted as a
UTF-8 decoder (RFC 3629 table 3-7) and refuses, in the mask and in
`accept_tokens`, every token whose bytes would make them ill-formed.

States: 0 (between characters), else (continuation bytes still needed, the
range the next one must fall in). Per state, a bitmask row of the tokens allowed
and, per token, the state it leads to (`INVALID` if refused); built once per
vocabulary (~0.1 s: only tokens with a byte >= 0x80 are walked).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from formwork.grammar.vocab import TokenVocab

INVALID = -1
_CONT = (0x80, 0xBF)
# (continuation bytes needed, range of the next one) -> state index; 0 is "between"
_STATES = [(0, (0, 0)), (1, _CONT), (2, _CONT), (2, (0xA0, 0xBF)), (2, (0x80, 0x9F)),
           (3, _CONT), (3, (0x90, 0xBF)), (3, (0x80, 0x8F))]
_INDEX = {s: i for i, s in enumerate(_STATES)}


def _lead(byte: int) -> int:
    """The state after `byte` between characters, INVALID if it cannot start one."""
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return _INDEX[(1, _CONT)]
    if byte == 0xE0:
        return _INDEX[(2, (0xA0, 0xBF))]
    if byte == 0xED:
        return _INDEX[(2, (0x80, 0x9F))]
    if 0xE1 <= byte <= 0xEF:
        return _INDEX[(2, _CONT)]
    if byte == 0xF0:
        return _INDEX[(3, (0x90, 0xBF))]
    if byte == 0xF4:
        return _INDEX[(3, (0x80, 0x8F))]
    if 0xF1 <= byte <= 0xF3:
        return _INDEX[(3, _CONT)]
    return INVALID


def advance(state: int, data: bytes) -> int:
    """The decoder state after `data` from `state`, INVALID if ill-formed."""
    for byte in data:
        if state == 0:
            state = _lead(byte)
        else:
            need, (lo, hi) = _STATES[state]
            if not lo <= byte <= hi:
                return INVALID
            state = 0 if need == 1 else _INDEX[(need - 1, _CONT)]
        if state == INVALID:
            return INVALID
    return state


class ByteGuard:
    """A byte automaton over a matcher's output: per state, a bitmask row of the
    tokens allowed (`rows`, little-endian int32 words as `allowed_mask` reads them)
    and `step` to the state after some tokens (INVALID if one is refused)."""

    rows: torch.Tensor
    state0_refuses: bool        # does the start state refuse any token?

    def step(self, state: int, token_ids: Sequence[int]) -> int:
        raise NotImplementedError

    def restrict(self, bitmask: torch.Tensor, row: int, state: int) -> None:
        """AND the mask's `row` with the tokens allowed in `state`."""
        if state or self.state0_refuses:
            bitmask[row].bitwise_and_(self.rows[state, : bitmask.shape[1]])


class Utf8Guard(ByteGuard):
    """Per vocabulary: allowed-token rows and next states for each decoder state."""

    def __init__(self, vocab: TokenVocab):
        n = vocab.vocab_size
        words = (n + 31) // 32
        # numpy, not torch: ops this big on the engine thread would open an OpenMP
        # region there (see `allocate_bitmask`)
        allowed = np.zeros((len(_STATES), words * 32), dtype=bool)
        self.next: list[dict[int, int]] = [{} for _ in _STATES]   # non-ASCII tokens only
        ascii_ids = []
        for tid, data in enumerate(vocab.token_bytes[:n]):
            if data is None:                    # special tokens: the grammar decides, between
                allowed[0, tid] = True          # characters (not inside one)
                continue
            if max(data, default=0) < 0x80:
                ascii_ids.append(tid)
                continue
            for s in range(len(_STATES)):
                end = advance(s, data)
                self.next[s][tid] = end
                allowed[s, tid] = end != INVALID
        allowed[0, ascii_ids] = True            # ASCII only between characters
        # token bits as the bitmask's little-endian int32 words (as `allowed_mask` reads them)
        self.rows = torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))
        self.state0_refuses = not bool(allowed[0, :n].all())

    def step(self, state: int, token_ids: Sequence[int]) -> int:
        """The state after `token_ids`, INVALID if any of them is refused."""
        for tid in token_ids:
            end = self.next[state].get(int(tid))
            if end is None:                     # ASCII or special: fine between characters only
                end = 0 if state == 0 else INVALID
            if end == INVALID:
                return INVALID
            state = end
        return state
