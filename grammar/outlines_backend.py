"""outlines-core backend: json (as a regex), regex, choice.

The vocabulary is built from the tokenizer's decoded token bytes (no model
hub). outlines-core lists the eos token as allowed at accepting states but
refuses to advance over it, so termination is tracked here.
"""
from __future__ import annotations

from collections.abc import Sequence

import outlines_core as oc
import torch

from formwork.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    bitmask_words,
    complete_utf8_prefix,
    set_only_tokens,
)
from formwork.grammar.outlines_grammar import to_regex
from formwork.grammar.outlines_worker import build_index
from formwork.grammar.schema_check import UnsupportedSchemaError, native_schema_error
from formwork.grammar.vocab import TokenVocab
from formwork.schemas.structured import StructuredOutputsParams

MAX_ROLLBACK = 256          # tokens a matcher can roll back
_JUMP_MAX_CANDIDATES = 256  # states allowing more tokens than this force nothing useful


def _common_prefix(items: list[bytes]) -> bytes:
    lo, hi = min(items), max(items)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


class OutlinesCompiled(CompiledGrammar):
    backend_name = "outlines"

    def __init__(self, index: oc.Index, vocab: TokenVocab, by_bytes: dict[bytes, int]):
        self.index = index
        self.vocab = vocab
        self.by_bytes = by_bytes

    def new_matcher(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self)


class OutlinesMatcher(Matcher):
    def __init__(self, compiled: OutlinesCompiled):
        self._c = compiled
        self._guide = oc.Guide(compiled.index, max_rollback=MAX_ROLLBACK)
        self._eos = compiled.vocab.eos_token_id
        self._terminated = False
        # Accepted token ids since reset: the guide keeps only MAX_ROLLBACK states,
        # so a longer undo resets and replays these instead.
        self._history: list[int] = []

    def _undo(self, n: int) -> None:
        """Take back the last n advanced tokens (all in self._history)."""
        if n <= MAX_ROLLBACK:
            self._guide.rollback_state(n)
        else:
            self._guide.reset()
            for tid in self._history[:len(self._history) - n]:
                self._guide.advance(tid, False)
        del self._history[len(self._history) - n:]

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        advanced, was_terminated = 0, self._terminated
        for tid in token_ids:
            ok = not self._terminated
            if ok and tid == self._eos:
                ok = self._terminated = self._guide.is_finished()
            elif ok:
                try:
                    self._guide.advance(int(tid), False)
                    self._history.append(int(tid))
                    advanced += 1
                except ValueError:
                    ok = False
            if not ok:
                if advanced:
                    self._undo(advanced)
                self._terminated = was_terminated
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            set_only_tokens(bitmask, row, [self._eos])
            return
        words = bitmask_words(self._c.vocab.vocab_size)
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
        assert bitmask.shape[1] == words and bitmask.device.type == "cpu"
        self._guide.write_mask_into(bitmask[row].data_ptr(), words, 4)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._undo(num_tokens)

    def reset(self) -> None:
        self._guide.reset()
        self._history.clear()
        self._terminated = False
        self._terminated = False

    def jump_forward_string(self) -> str:
        """Follow states whose allowed tokens all share a prefix (and are not final)."""
        if self._terminated:
            return ""
        index, token_bytes = self._c.index, self._c.vocab.token_bytes
        state, out = self._guide.get_state(), b""
        for _ in range(64):
            allowed = index.get_allowed_tokens(state)
            if not allowed or self._eos in allowed or len(allowed) > _JUMP_MAX_CANDIDATES:
                break
            prefix = _common_prefix([token_bytes[t] for t in allowed])
            out += prefix
            tid = self._c.by_bytes.get(prefix)
            if not prefix or tid is None or tid not in allowed:
                break
            state = index.get_next_state(state, tid)
            if state is None:
                break
        return complete_utf8_prefix(out)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, vocab: TokenVocab, *, compile_timeout_s: float = 60.0):
        mapping: dict[bytes, list[int]] = {}
        for tid, data in enumerate(vocab.token_bytes):
            if data is not None and tid != vocab.eos_token_id:
                mapping.setdefault(data, []).append(tid)
        self._vocabulary = oc.Vocabulary(vocab.eos_token_id, mapping)
        self._vocab = vocab
        self._by_bytes = {data: ids[0] for data, ids in mapping.items()}
        self._timeout_s = compile_timeout_s

    def check(self, params: StructuredOutputsParams) -> None:
        to_regex(params)

    def compile(self, params: StructuredOutputsParams) -> OutlinesCompiled:
        try:
            index = build_index(to_regex(params), self._vocabulary, self._timeout_s)
        except UnsupportedSchemaError:
            raise
        except ValueError as err:       # e.g. "... incompatible with the regex"
            if params.kind() != "json":
                raise
            raise native_schema_error(params.spec(), str(err), "outlines") from None
        return OutlinesCompiled(index, self._vocab, self._by_bytes)
