"""The matcher side of `uniqueItems` (grammar/unique_items.py has the plan and
the scanner): a wrapper around a backend's matcher that refuses every token
completing a duplicate item, in the mask and on accept."""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import torch

from formwork.grammar.backend import CompiledGrammar, Matcher, allowed_token_ids
from formwork.grammar.unique_items import _DELIMITERS, DocScan, TagScan, _Seg, _State
from formwork.grammar.vocab import TokenVocab, first_id_by_bytes


class TokenSets:
    """Per vocabulary (a backend builds one, ~50 ms): the tokens that can complete
    an item, by context."""

    def __init__(self, vocab: TokenVocab):
        tb = vocab.token_bytes
        self.bytes = tb
        self.quote = np.array([i for i, b in enumerate(tb) if b and b'"' in b], dtype=np.int64)
        self.digit = np.array([i for i, b in enumerate(tb) if b and any(48 <= c <= 57 for c in b)],
                              dtype=np.int64)
        self.delim = np.array([i for i, b in enumerate(tb) if b and any(c in _DELIMITERS for c in b)],
                              dtype=np.int64)
        self.risky = np.union1d(self.quote, self.digit)
        self.backslash = np.array([i for i, b in enumerate(tb) if b and b"\\" in b], dtype=np.int64)
        self.by_bytes = first_id_by_bytes(tb)


class UniqueItemsMatcher(Matcher):
    """`inner` (the grammar without the served `uniqueItems`) plus uniqueness, over
    what `scan` follows: one JSON document (DocScan) or the tags of free text (TagScan)."""

    def __init__(self, inner: Matcher, scan: DocScan | TagScan, sets: TokenSets):
        self.inner = inner
        self._scan = scan
        self._sets = sets
        self._states = [scan.initial()]
        # (token, state after it) that `accepts` found allowed in the current state: the
        # deferred-mask check asks, then the engine accepts the same token; it is not
        # scanned twice. Cleared by every state change.
        self._checked: tuple[int, _State | _Seg] | None = None

    @property
    def error(self) -> str:
        return getattr(self.inner, "error", "")

    def _after(self, token_ids: Sequence[int]) -> list[_State | _Seg] | None:
        st, out = self._states[-1], []
        for t in token_ids:
            data = self._sets.bytes[t] if 0 <= t < len(self._sets.bytes) else None
            if data:
                nxt = self._scan.follows(st, data)
                if nxt is None:
                    return None
                st = nxt
            out.append(st)
        return out

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        ids = [int(t) for t in token_ids]
        checked, self._checked = self._checked, None
        states = [checked[1]] if checked is not None and ids == [checked[0]] else self._after(ids)
        if states is None or not self.inner.accept_tokens(token_ids):
            return False
        self._states += states
        return True

    def accepts(self, token_id: int) -> bool:
        states = self._after([int(token_id)])
        if states is None or not self.inner.accepts(token_id):
            return False
        self._checked = (int(token_id), states[0])
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        self.restrict(bitmask, row)

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear, in `bitmask[row]` (filled by the inner matcher), the tokens that
        would complete a duplicate item."""
        state = self._states[-1]
        st = self._scan.json(state)
        if st is None or self.inner.is_terminated():
            return              # free text between tags: a token there completes no item
        sets = self._sets
        words = bitmask[row].numpy().view(np.uint32)
        if st.frames and st.frames[-1].kind == "e":    # any token may leave only taken values
            allowed = np.array(allowed_token_ids(bitmask, row, len(sets.bytes)), dtype=np.int64)
        else:
            cands = sets.risky
            if st.lex == "num" and st.track:
                cands = np.union1d(cands, sets.delim)
            elif st.lex == "str" and st.track and st.frames[-1].max_len is not None:
                cands = np.union1d(cands, self._to_max_length(st))
            cands = cands[cands < words.shape[0] * 32]
            on = (words[cands >> 5] >> (cands & 31).astype(np.uint32)) & 1
            allowed = cands[on.astype(bool)]
        for t in allowed.tolist():
            if sets.bytes[t] and self._scan.follows(state, sets.bytes[t]) is None:
                words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def _to_max_length(self, st: _State) -> np.ndarray:
        """Tokens that may bring a string item to its maxLength (where it can only
        close) equal to a taken item: the rest of each such item as one token, and
        every token with an escape."""
        top = st.frames[-1]
        try:
            so_far = json.loads(b'"' + st.buf + b'"')
        except ValueError:
            return self._sets.backslash
        ids = [self._sets.by_bytes.get(u[len(so_far):].encode()) for u in top.items
               if isinstance(u, str) and len(u) == top.max_len and u.startswith(so_far)]
        return np.union1d(self._sets.backslash, np.array([i for i in ids if i is not None],
                                                          dtype=np.int64))

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._checked = None
        if num_tokens:
            self.inner.rollback(num_tokens)
            del self._states[-num_tokens:]

    def reset(self) -> None:
        self._checked = None
        self.inner.reset()
        self._states = [self._scan.initial()]

    def jump_forward_string(self) -> str:
        forced = self.inner.jump_forward_string()
        if forced and self._scan.follows(self._states[-1], forced.encode()) is None:
            return ""
        return forced


class UniqueItemsCompiled(CompiledGrammar):
    def __init__(self, inner: CompiledGrammar, scan: DocScan | TagScan, sets: TokenSets):
        self.inner = inner
        self.backend_name = inner.backend_name
        self.scan = scan
        self._sets = sets

    def new_matcher(self) -> UniqueItemsMatcher:
        return UniqueItemsMatcher(self.inner.new_matcher(), self.scan, self._sets)
