"""The grammar-backend seam: compile a constraint once, match it per request.

Bitmask layout (shared by every backend, xgrammar's layout): an int32 tensor
`[rows, bitmask_words(vocab_size)]` on CPU; bit j of word w set <=> token id
`32 * w + j` is allowed. `vocab_size` is the model's logits width; ids the
tokenizer does not know (padding ids, special/added tokens) are never allowed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from formwork.schemas.structured import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask `[rows, bitmask_words(vocab_size)]` (int32, CPU).

    Built by numpy, not `torch.full`: this runs on the engine thread, and a torch op
    big enough to open an OpenMP parallel region there (here from 22 rows on) left
    the forward thread's team without its spin-wait for the rest of the process:
    measured, unconstrained batch-32 decoding fell from 1,018 to 536 tok/s after
    the first constrained batch had grown this buffer."""
    return torch.from_numpy(np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32))


def set_only_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Make `bitmask[row]` allow exactly `token_ids`."""
    bitmask[row].zero_()
    for tid in token_ids:
        word, bit = divmod(tid, 32)
        # int32 word: bit 31 is the sign bit, so build the value in Python ints.
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def allowed_mask(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """Bool `[vocab_size]`: token allowed by `bitmask[row]` (tests, debugging; O(vocab))."""
    # little-endian int32 words: bit j of word w is bit j % 8 of byte 4w + j // 8
    as_bytes = bitmask[row].contiguous().numpy().view(np.uint8)
    return torch.from_numpy(np.unpackbits(as_bytes, bitorder="little")[:vocab_size].astype(bool))


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """Token ids allowed by `bitmask[row]` (tests, debugging; O(vocab))."""
    return torch.nonzero(allowed_mask(bitmask, row, vocab_size)).flatten().tolist()


def complete_utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` made of whole UTF-8 characters, decoded."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class Matcher(ABC):
    """Mutable matching state of one request. Not thread-safe: one owner thread."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids` (the stop token terminates). All or nothing:
        on False the state is unchanged."""

    def accepts(self, token_id: int) -> bool:
        """Whether `token_id` is allowed next, i.e. set in the row fill_bitmask would
        write (tests/test_deferred_masks.py checks the two agree); state unchanged."""
        if not self.accept_tokens([token_id]):
            return False
        self.rollback(1)
        return True

    def closes_with(self, token_ids: Sequence[int], eos_token_id: int | None) -> bool:
        """Whether `token_ids` are accepted in turn and the output may end after them
        (the stop token is allowed there); state unchanged."""
        ids = list(token_ids)
        if not self.accept_tokens(ids):
            return False
        try:
            return self.is_terminated() or (eos_token_id is not None and
                                            self.accepts(eos_token_id))
        finally:
            self.rollback(len(ids))

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`; does not mutate state.
        Once terminated, the row allows only the stop token."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the stop token was accepted at an accepting position."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a terminating stop token counts)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The longest string every accepted continuation starts with ('' if none).
        Does not mutate state."""


class CompiledGrammar(ABC):
    """Immutable compiled constraint, shareable across requests and threads."""

    backend_name: str

    @abstractmethod
    def new_matcher(self) -> Matcher:
        """A fresh matcher at the initial state."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer/vocabulary."""

    name: str

    @abstractmethod
    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError (UnsupportedSchemaError for unenforceable JSON Schema
        keywords) if this backend cannot enforce `params` exactly. Cheap-ish: no
        token-mask compilation."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile `params` (after `check`); thread-safe; may take seconds."""

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Fill `bitmask[rows[i]]` for `matchers[i]` (all made by this backend)."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)
