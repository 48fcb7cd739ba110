"""Thinking first, then the constraint (`StructuredOutputsParams.reasoning_end`):
a reasoning model writes free text up to its end-of-thinking token (Qwen3's and
DeepSeek-R1's `</think>`, one token of their vocabularies), and the request's
grammar applies to what follows, as vLLM does under `--reasoning-parser`.

While thinking, the mask allows every ordinary token, the added tokens that are
not special (the start tag too) and the end tag, never the end-of-sequence token
nor another special token (either would end the request or leak template markup
before the constrained part was written), so a finished
output always holds its constrained part after the tag: what the gateway splits
off as `content` validates like any constrained output. The wrapper follows the
same contract as the backends' matchers (rollback across the tag included), so
deferred masks and jump-forward (only after the tag: there is nothing to force
before it) work unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from formwork.grammar.backend import Matcher, bitmask_words
from formwork.grammar.vocab import TokenVocab


def thinking_mask(vocab: TokenVocab, tokenizer, end_id: int) -> torch.Tensor:
    """[1, words] int32: the ordinary tokens, the added tokens that are not special
    (Qwen3's `<think>`, `<tool_call>`: text to the model) and `end_id`; not the
    special ones (end of sequence, template markup). Built as the guards build their
    rows (utf8_guard.py): a bool row packed into the little-endian int32 words."""
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | {vocab.eos_token_id}
    allowed = np.zeros((1, bitmask_words(vocab.vocab_size) * 32), dtype=bool)
    allowed[0, [i for i, b in enumerate(vocab.token_bytes) if b is not None]] = True
    allowed[0, [i for i in (getattr(tokenizer, "added_tokens_decoder", {}) or {})
                if i not in special and i < vocab.vocab_size]] = True
    allowed[0, end_id] = True
    return torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))


class ThinkFirstMatcher(Matcher):
    """Free text up to `end_id` (allowed by `thinking` [1, words]), then `inner`."""

    def __init__(self, inner: Matcher, end_id: int, thinking: torch.Tensor):
        self.inner = inner
        self._end = end_id
        self._thinking = thinking
        self._before = 0                # tokens accepted before the tag
        self._ended = False             # the tag accepted
        self._after = 0                 # tokens the inner matcher accepted

    @property
    def error(self) -> str:
        return getattr(self.inner, "error", "")

    @property
    def thinking(self) -> bool:
        return not self._ended

    def _thinks(self, token_id: int) -> bool:
        word, bit = divmod(token_id, 32)
        return 0 <= word < self._thinking.shape[1] and bool(
            (int(self._thinking[0, word]) >> bit) & 1)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        before, ended = self._before, self._ended
        i = 0
        while i < len(token_ids) and not self._ended:
            t = int(token_ids[i])
            if not self._thinks(t):
                self._before, self._ended = before, ended
                return False
            if t == self._end:
                self._ended = True
            else:
                self._before += 1
            i += 1
        rest = list(token_ids[i:])
        if rest:
            if not self.inner.accept_tokens(rest):
                self._before, self._ended = before, ended
                return False
            self._after += len(rest)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._ended:
            self.inner.fill_bitmask(bitmask, row)
        else:
            bitmask[row].copy_(self._thinking[0])

    def is_terminated(self) -> bool:
        return self._ended and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        inner = min(num_tokens, self._after)
        if inner:
            self.inner.rollback(inner)
            self._after -= inner
        left = num_tokens - inner
        if left and self._ended:
            self._ended = False
            left -= 1
        assert left <= self._before, "rollback past the start"
        self._before -= left

    def reset(self) -> None:
        self.inner.reset()
        self._before, self._ended, self._after = 0, False, 0

    def jump_forward_string(self) -> str:
        return self.inner.jump_forward_string() if self._ended else ""
