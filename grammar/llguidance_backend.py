"""llguidance backend (vLLM's `guidance`): matchers and batched mask fills for the
grammars grammar/llguidance_grammar.py builds.

Special and added tokens are handed to llguidance as special (a leading 0xFF
byte), so no grammar made here ever allows them.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance as llg
import torch

from formwork.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    complete_utf8_prefix,
    set_only_tokens,
)
from formwork.grammar import unique_items, unique_items_matcher
from formwork.grammar.llguidance_grammar import LIMITS, to_llguidance
from formwork.grammar.structural_tag import LarkContent, triggered_tags
from formwork.grammar.vocab import PlainEncoder, TokenVocab
from formwork.schemas.structured import StructuredOutputsParams



class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: per-id bytes (specials marked with a
    leading 0xFF), eos, and a tokenize callable (used for its own fast-forward)."""

    def __init__(self, vocab: TokenVocab, tokenizer):
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        self.tokens = [b if b is not None else b"\xff" + (vocab.encoded[i] or f"[{i}]").encode()
                       for i, b in enumerate(vocab.token_bytes)]
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if b is None]
        # llguidance tokenizes the text a grammar forces with this and allows those
        # tokens: a special token's spelling inside a JSON key or enum value must come
        # back as ordinary tokens, or the mask allows the special token alone (which
        # the matcher then refuses: the request failed with "grammar rejected token").
        self._encode = PlainEncoder(tokenizer, vocab)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class LLGuidanceMatcher(Matcher):
    def __init__(self, native: llg.LLMatcher, eos_token_id: int):
        self.native = native
        self._eos = eos_token_id
        self._terminated = False   # the eos token was accepted
        # A token `accepts` found valid in the current state: the deferred-mask check
        # asks, then the engine accepts the same token; its validation is not repeated
        # (~7 us per request per step). Cleared by every state change.
        self._valid_next: int | None = None

    @property
    def error(self) -> str:
        """Why the matcher stopped working (a resource limit), '' if it did not."""
        return self.native.get_error() if self.native.is_error() else ""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        # Checked before consuming: a refused token would put llguidance in a
        # permanent error state. Its validate_tokens refuses the eos token once
        # the grammar can go no further, so a final eos is checked by acceptance.
        ids = [int(t) for t in token_ids]
        stop = bool(ids) and ids[-1] == self._eos
        body = ids[:-1] if stop else ids
        known, self._valid_next = self._valid_next, None
        if self._terminated or self.native.is_error():
            return False
        if not (len(body) == 1 and body[0] == known) \
                and self.native.validate_tokens(body) != len(body):
            return False
        if not self.native.consume_tokens(body):     # a resource limit hit while consuming
            return False
        if stop:
            if not self.native.is_accepting():
                self.native.rollback(len(body))
                return False
            # The eos token is not handed to llguidance (it keeps no rollback entry
            # for it): termination is tracked here, the native state stays put.
            self._terminated = True
        return True

    def accepts(self, token_id: int) -> bool:
        if self._terminated or self.native.is_error():
            return False
        if token_id == self._eos:
            return self.native.is_accepting()
        ok = self.native.validate_tokens([int(token_id)]) == 1
        if ok:
            self._valid_next = int(token_id)
        return ok

    def closes_with(self, token_ids: Sequence[int], eos_token_id: int | None) -> bool:
        # Validated, not consumed: ~2 us where consuming and rolling back a string's
        # closing `"}` and `]}` took ~0.1 ms. An eos the validation refuses is asked
        # by acceptance (see accept_tokens).
        ids = [int(t) for t in token_ids]
        if self._terminated or self.native.is_error() or eos_token_id is None:
            return super().closes_with(ids, eos_token_id)
        done = self.native.validate_tokens(ids + [int(eos_token_id)])
        if done == len(ids) + 1:
            return True
        return done == len(ids) and super().closes_with(ids, eos_token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated or self.native.is_error():
            set_only_tokens(bitmask, row, [self._eos])
            return
        target = bitmask[row]
        self.native.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        self._valid_next = None
        if num_tokens and self._terminated:
            self._terminated, num_tokens = False, num_tokens - 1
        if num_tokens and not self.native.is_error():   # a failed matcher stays failed
            assert self.native.rollback(num_tokens), self.native.get_error()

    def reset(self) -> None:
        self._valid_next = None
        self.native.reset()
        self._terminated = False

    def jump_forward_string(self) -> str:
        if self._terminated or self.native.is_error():
            return ""
        return complete_utf8_prefix(self.native.compute_ff_bytes())


class LLGuidanceCompiled(CompiledGrammar):
    """The grammar string and the first matcher, built in the compile pool; later
    matchers are built fresh (llguidance's deep_copy was seen to break a copy)."""
    backend_name = "llguidance"

    def __init__(self, grammar: str, tokenizer: llg.LLTokenizer, eos_token_id: int):
        self.grammar = grammar
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self._first: llg.LLMatcher | None = self._build()

    def _build(self) -> llg.LLMatcher:
        native = llg.LLMatcher(self._tokenizer, self.grammar, log_level=0,
                               limits=llg.LLParserLimits(**LIMITS))
        if native.is_error():
            raise ValueError(f"llguidance cannot compile this constraint: {native.get_error()}")
        return native

    def new_matcher(self) -> LLGuidanceMatcher:
        native, self._first = (self._first, None) if self._first is not None else (self._build(), None)
        return LLGuidanceMatcher(native, self._eos)


def unique_scan(params: StructuredOutputsParams) -> unique_items.DocScan | unique_items.TagScan | None:
    """What the `uniqueItems` wrapper follows for `params`, None when no site is served:
    a JSON schema's document, or the tags of a structural tag (tool calls in
    `tool_choice: "auto"`; each tag's JSON value is followed with its own plan)."""
    kind = params.kind()
    if kind == "json":
        plan = unique_items.plan(params.spec())
        return unique_items.DocScan(plan) if plan.sites else None
    if kind == "structural_tag":
        try:
            tags = triggered_tags(params.spec(), params, check=lambda s: s).tags
        except ValueError:      # another shape (an answer or calls): no site is served there
            return None
        plans = [(begin, unique_items.plan(schema)) for begin, schema, _ in tags
                 if not isinstance(schema, LarkContent)]       # a grammar's text: no JSON
        return unique_items.TagScan(plans) if any(p.sites for _, p in plans) else None
    return None


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: TokenVocab, tokenizer, *, max_threads: int = 2,
                 batch_fill_min: int = 64):
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(vocab, tokenizer)),
                                         n_vocab=vocab.vocab_size)
        # As with xgrammar: on 2 busy cores one-by-one fills beat the thread pool
        # for small batches.
        self._executor = llg.LLExecutor(max_threads)
        self._batch_fill_min = batch_fill_min
        self._eos = vocab.eos_token_id
        self._vocab = vocab
        self._sets: unique_items_matcher.TokenSets | None = None
        self._sets_lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        to_llguidance(params)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        compiled = LLGuidanceCompiled(to_llguidance(params), self.tokenizer, self._eos)
        scan = unique_scan(params)
        if scan is not None:
            return unique_items_matcher.UniqueItemsCompiled(compiled, scan, self._unique_sets())
        return compiled

    def _unique_sets(self) -> unique_items_matcher.TokenSets:
        """The vocabulary's token sets for `uniqueItems` matchers, built on first use
        (compile threads may ask at once)."""
        with self._sets_lock:
            if self._sets is None:
                self._sets = unique_items_matcher.TokenSets(self._vocab)
            return self._sets

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        live: list[tuple[llg.LLMatcher, int]] = []
        first_row: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        unique: list[tuple[unique_items_matcher.UniqueItemsMatcher, int]] = []
        for m, row in zip(matchers, rows):
            if id(m) in first_row:          # one matcher filled once, from one thread
                copies.append((first_row[id(m)], row))
                continue
            first_row[id(m)] = row
            if isinstance(m, unique_items_matcher.UniqueItemsMatcher):   # inner fill, then restrict
                unique.append((m, row))
                m = m.inner
            assert isinstance(m, LLGuidanceMatcher)
            if m.is_terminated() or m.native.is_error() or len(matchers) < self._batch_fill_min:
                m.fill_bitmask(bitmask, row)
            else:
                live.append((m.native, row))
        if live:
            assert bitmask.is_contiguous()
            self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), bitmask.shape[1] * 4,
                                                   bitmask.shape[0])
        for m, row in unique:
            m.restrict(bitmask, row)
        for src, dst in copies:
            bitmask[dst].copy_(bitmask[src])
