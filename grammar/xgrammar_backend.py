"""xgrammar backend: every constraint kind, exact or rejected.

Conversions to an xgrammar `Grammar` run with native warnings captured
(`native_log`): any part of a constraint xgrammar would drop is an error.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from formwork.grammar.backend import CompiledGrammar, GrammarBackend, Matcher, set_only_tokens
from formwork.grammar.native_log import call_capturing_warnings
from formwork.grammar.regex_classes import portable_classes
from formwork.grammar.schema_check import (
    SchemaIssue,
    UnsupportedSchemaError,
    check_schema,
    locate_keyword,
    native_schema_error,
)
from formwork.grammar.escape_guard import SurrogateEscapeGuard
from formwork.grammar.structural_tag import structural_tag_spec
from formwork.grammar.utf8_guard import INVALID, ByteGuard, Utf8Guard
from formwork.grammar.schema_walk import iter_nodes
from formwork.grammar.vocab import TokenVocab, VocabKind
from formwork.grammar.xgrammar_productive import (InfiniteGrammarError, NoFiniteOutput,
                                                  recursive_refs, unproductive_rules)
from formwork.schemas.structured import StructuredOutputsParams

# Constraints whose output is JSON (a structural tag's free text too: escape_guard.py)
_JSON_KINDS = ("json", "json_object", "structural_tag")
# One request's mask (or forced-text search) may take this long, once: then its
# matcher fails and the engine ends that request with the error. xgrammar's parser
# keeps every way an ambiguous constraint can split the text so far, and for nested
# repetitions that can match the same text that work grows step after step (measured,
# `(([a-z]*)*)*`: twice the time each token; a 60-character regex in a random test:
# 0.5 s at its 2nd token, 13 s at its 16th), stalling every request on the engine.
# Measured fills are 0.05-1 ms for ordinary constraints, ~50 ms for a 20,000-way choice.
# Where the work grows slowly ((a|b|ab)*)*c: ~60 ms a token, 25 s for 400) no single
# step reaches that, so a request's matcher also has a budget for all its steps.
# Both count the CPU time of the thread doing the work (`_cpu`), not the wall clock: on
# a box six times oversubscribed the wall clock of an email format's 20-33 ms masks ran
# past the budget in 40 tokens and failed a grammar that is not ambiguous at all; CPU
# time is the grammar's own cost, whatever else runs (25x a large schema's fill).
FILL_LIMIT_S = 0.5
BUDGET_BASE_S, BUDGET_PER_TOKEN_S = 5.0, 0.025
_cpu = time.thread_time    # xgrammar's single-matcher calls run on the calling thread

_VOCAB_TYPES = {VocabKind.BYTE_LEVEL: xgr.VocabType.BYTE_LEVEL,
                VocabKind.BYTE_FALLBACK: xgr.VocabType.BYTE_FALLBACK,
                VocabKind.RAW: xgr.VocabType.RAW}
# Which keyword a native warning is about (message substring -> keyword).
_WARNING_KEYWORDS = (("minLength/maxLength", "maxLength"), ("length constraints", "maxLength"),
                     ("multipleOf", "multipleOf"), ("oneOf", "oneOf"), ("allOf", "allOf"),
                     ("Lookahead", "pattern"), ("Anchor", "pattern"), ("URI", "$ref"))


def native_error_text(err: Exception) -> str:
    """First line of an xgrammar error without its '[time] file.cc:line: ' prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[\d:]+\] \S+\.cc:\d+: ", "", text)


def json_schema_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """Whitespace options: none at all, or at most `max_whitespace` chars per run."""
    if params.whitespace == "compact" or params.max_whitespace == 0:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": params.max_whitespace}


def choice_ebnf(choices: Sequence[str]) -> str:
    # json.dumps quotes and escapes exactly like xgrammar's EBNF string literals.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar treats every oneOf it cannot prove disjoint as anyOf and says so, even
# {array} | {null}. The schema checks already proved each reachable oneOf's
# branches disjoint (or rejected the schema), and anyOf over disjoint branches
# is oneOf, so this warning alone is harmless.
_PROVEN_ELSEWHERE = ("oneOf with overlapping or non-provably-disjoint branches",)


def _convert(kind: str, fn, schema: Any = None) -> xgr.Grammar:
    """`schema`: the JSON Schema being converted, so that xgrammar's own errors
    about it name a keyword and a path."""
    try:
        grammar, warnings = call_capturing_warnings(fn)
    except (RuntimeError, ValueError, TypeError) as err:
        if schema is not None:
            raise native_schema_error(schema, native_error_text(err), "xgrammar") from None
        raise ValueError(f"xgrammar cannot compile this {kind}: {native_error_text(err)}") from None
    if kind in ("JSON Schema", "structural tag"):
        warnings = [w for w in warnings if not w.startswith(_PROVEN_ELSEWHERE)]
    if warnings:
        keyword = next((kw for key, kw in _WARNING_KEYWORDS if key in warnings[0]), kind)
        if kind == "JSON Schema":
            issues = [SchemaIssue(keyword, "$", f"xgrammar: {w}") for w in warnings]
            raise UnsupportedSchemaError(issues, "xgrammar")
        raise ValueError(f"xgrammar would not enforce this {kind} exactly: {warnings[0]}")
    return grammar


def to_xgrammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """Check `params` and convert it to an xgrammar Grammar (no tokenizer needed)."""
    return _checked(params)[0]


def _checked(params: StructuredOutputsParams) -> tuple[xgr.Grammar, bool]:
    """The Grammar, and whether jump-forward may run on it: refused where a rule
    derives no finite text (xgrammar's jump-forward never returns there, see
    xgrammar_productive.py); jump-forward off where that could not be read."""
    grammar = _converted(params)
    unproductive = unproductive_rules(str(grammar))
    if unproductive:
        if params.kind() == "json":
            raise _infinite_schema(params.spec())
        raise _infinite_grammar(params.kind(), unproductive[0])
    return grammar, unproductive is not None


def _infinite_grammar(kind: str, rule: str) -> InfiniteGrammarError:
    return InfiniteGrammarError(
        f"this {kind.replace('_', ' ')} admits no output that ends: rule {rule!r} derives no "
        "finite text (each of its alternatives needs itself or another such rule)")


class InfiniteSchemaError(UnsupportedSchemaError, NoFiniteOutput):
    pass


def _infinite_schema(schema: Any) -> InfiniteSchemaError:
    keyword = "$ref" if any("$ref" in n.schema for n in iter_nodes(schema)) else "required"
    return InfiniteSchemaError([SchemaIssue(
        keyword, locate_keyword(schema, keyword),
        "no finite instance: a required property's schema refers back to an enclosing one, "
        "so every instance nests without end")], "xgrammar")


def check_finite_grammar(ebnf: str) -> None:
    """InfiniteGrammarError where a rule of the GBNF grammar `ebnf` derives no finite
    text; no verdict where xgrammar does not read it (Lark: llguidance's dialect)."""
    try:
        grammar, _ = call_capturing_warnings(lambda: xgr.Grammar.from_ebnf(ebnf))
    except (RuntimeError, ValueError, TypeError):
        return
    if unproductive := unproductive_rules(str(grammar)):
        raise _infinite_grammar("grammar", unproductive[0])


def check_finite_json(schema: Any) -> None:
    """InfiniteSchemaError where `schema` has no finite instance, for every backend
    (checked on xgrammar's conversion of it; recursive schemas only, see
    `recursive_refs`). No verdict where xgrammar cannot convert the schema."""
    if not isinstance(schema, dict) or not recursive_refs(schema):
        return
    try:
        grammar, _ = call_capturing_warnings(
            lambda: xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True))
    except (RuntimeError, ValueError, TypeError):
        return
    if unproductive_rules(str(grammar)):
        raise _infinite_schema(schema)


def _converted(params: StructuredOutputsParams) -> xgr.Grammar:
    kind, spec = params.kind(), params.spec()
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is served by backends "
                         "'llguidance' and 'outlines' only (xgrammar takes no whitespace regex)")
    if params.additional_properties == "schema" and kind in ("json", "structural_tag"):
        raise ValueError("structured_outputs.additional_properties='schema' is served by "
                         "backend 'llguidance' only (xgrammar never generates undeclared properties)")
    if kind == "json":
        schema = check_schema(spec, "xgrammar")
        schema = {} if schema is True else schema
        return _convert("JSON Schema", lambda: xgr.Grammar.from_json_schema(
            json.dumps(schema), strict_mode=True, **json_schema_options(params)), spec)
    if kind == "json_object":
        return _convert("JSON Schema", lambda: xgr.Grammar.from_json_schema(
            '{"type": "object"}', strict_mode=False, **json_schema_options(params)))
    if kind == "regex":
        # its \s takes U+FEFF and its \S, \D, \W what Python's `re` refuses: regex_classes.py
        return _convert("regex", lambda: xgr.Grammar.from_regex(portable_classes(spec)))
    if kind == "choice":
        return _convert("choice", lambda: xgr.Grammar.from_ebnf(choice_ebnf(spec)))
    if kind == "grammar":
        return _convert("grammar", lambda: xgr.Grammar.from_ebnf(spec))
    tag = structural_tag_spec(spec, params, check=lambda schema: check_schema(schema, "xgrammar"))
    return _convert("structural tag", lambda: xgr.Grammar.from_structural_tag(json.dumps(tag)))


class XGrammarMatcher(Matcher):
    """xgrammar's matcher behind byte guards it needs: well-formed UTF-8 always
    (utf8_guard), no surrogate escapes in JSON (escape_guard)."""

    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_id: int,
                 guards: tuple[ByteGuard, ...], jump_forward: bool = True):
        self.native = xgr.GrammarMatcher(compiled)
        self._eos = eos_token_id
        self._guards = guards
        self._jump_forward = jump_forward
        self._states = [(0,) * len(guards)]    # each guard's state after each accepted token
        self.error = ""          # set when it ran past its time limits: refuses from then on
        self._spent, self._tokens = 0.0, 0

    def _timed(self, what: str, seconds: float) -> None:
        self._spent += seconds
        budget = BUDGET_BASE_S + BUDGET_PER_TOKEN_S * self._tokens
        if self.error or (seconds <= FILL_LIMIT_S and self._spent <= budget):
            return
        took = (f"{seconds:.2f} s for one token's {what} (the limit is {FILL_LIMIT_S} s)"
                if seconds > FILL_LIMIT_S else
                f"{self._spent:.1f} s over {self._tokens} tokens (the budget is "
                f"{BUDGET_BASE_S:g} s + {BUDGET_PER_TOKEN_S * 1000:g} ms a token)")
        self.error = (f"xgrammar took {took}: the constraint is too ambiguous for it, e.g. "
                      "nested repetitions that can match the same text such as (([a-z]*)*)*; "
                      "backend 'llguidance' (`auto`'s choice for regexes, and for grammars "
                      "that repeat what can be empty) serves them without a mask growing "
                      "with the text")

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        if self.error:
            return False
        states = []
        state = self._states[-1]
        for tid in token_ids:
            state = tuple(g.step(s, (tid,)) for g, s in zip(self._guards, state))
            if INVALID in state:        # bytes xgrammar would take and a guard refuses
                return False
            states.append(state)
        start = _cpu()
        for n, tid in enumerate(token_ids):
            if not self.native.accept_token(int(tid)):
                if n:
                    self.native.rollback(n)
                return False
        self._tokens += len(token_ids)
        self._timed("advance", _cpu() - start)
        self._states += states
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.native.is_terminated():
            set_only_tokens(bitmask, row, [self._eos])
        else:
            self.timed_fill(bitmask, row)
            self.restrict(bitmask, row)

    def timed_fill(self, bitmask: torch.Tensor, row: int) -> None:
        start = _cpu()
        self.native.fill_next_token_bitmask(bitmask, row)
        self._timed("mask", _cpu() - start)

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """AND `row` (filled by xgrammar) with what the guards allow next."""
        for guard, state in zip(self._guards, self._states[-1]):
            guard.restrict(bitmask, row, state)

    def is_terminated(self) -> bool:
        return self.native.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.native.rollback(num_tokens)
            del self._states[-num_tokens:]
            self._tokens -= num_tokens        # (the time they took stays spent)

    def reset(self) -> None:
        self.native.reset()
        self._states = [(0,) * len(self._guards)]
        self._spent, self._tokens = 0.0, 0

    def jump_forward_string(self) -> str:
        if not self._jump_forward or self.native.is_terminated() or self.error:
            return ""          # not proved to end (xgrammar_productive.py): never called
        start = _cpu()
        forced = self.native.find_jump_forward_string()
        self._timed("forced-text search", _cpu() - start)
        return "" if self.error else forced


class XGrammarCompiled(CompiledGrammar):
    backend_name = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_id: int,
                 guards: tuple[ByteGuard, ...], jump_forward: bool = True):
        self.native = compiled
        self._eos = eos_token_id
        self._guards = guards
        self._jump_forward = jump_forward

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.native, self._eos, self._guards,
                               jump_forward=self._jump_forward)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: TokenVocab, *, max_threads: int = 2, batch_fill_min: int = 64):
        # Tokens without bytes (special/added/padding ids, the eos itself) are
        # spelled "" so xgrammar treats them as special and never allows them.
        encoded = [tok if vocab.token_bytes[i] is not None else ""
                   for i, tok in enumerate(vocab.encoded)]
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, _VOCAB_TYPES[vocab.kind], vocab_size=vocab.vocab_size,
            stop_token_ids=[vocab.eos_token_id], add_prefix_space=vocab.add_prefix_space)
        # The manager keeps its own LRU of compiled grammars.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        # Measured on 2 busy cores: filling 8 or 32 matchers one by one beat
        # BatchGrammarMatcher (its threads cost more than they save), so it is
        # used only from `batch_fill_min` live matchers up.
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._batch_fill_min = batch_fill_min
        self._eos = vocab.eos_token_id
        self._utf8_guard = Utf8Guard(vocab)
        self._escape_guard = SurrogateEscapeGuard(vocab)

    def check(self, params: StructuredOutputsParams) -> None:
        to_xgrammar(params)

    def compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        grammar, jump_forward = _checked(params)
        guards: tuple[ByteGuard, ...] = (self._utf8_guard,)
        if params.kind() in _JSON_KINDS:
            guards += (self._escape_guard,)
        return XGrammarCompiled(self._compiler.compile_grammar(grammar), self._eos, guards,
                                jump_forward=jump_forward)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        live, live_rows = [], []
        # A matcher listed twice is filled once and its row copied: the batched
        # fill runs matchers on several threads, and one matcher filled from two
        # threads at once corrupts its parser state (xgrammar aborts or crashes).
        first_row: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        for m, row in zip(matchers, rows):
            assert isinstance(m, XGrammarMatcher)
            if id(m) in first_row:
                copies.append((first_row[id(m)], row))
                continue
            first_row[id(m)] = row
            if m.is_terminated():
                m.fill_bitmask(bitmask, row)
            else:
                live.append(m)
                live_rows.append(row)
        start = time.perf_counter()
        if len(live) >= self._batch_fill_min:
            self._batch.batch_fill_next_token_bitmask([m.native for m in live], bitmask, live_rows)
            # its threads' CPU time is not this thread's: a wall clock past the limit
            # (a busy box, or one matcher's work) has each filled again, timed on its own
            if time.perf_counter() - start > FILL_LIMIT_S:
                for m, row in zip(live, live_rows):
                    m.timed_fill(bitmask, row)
        else:
            for m, row in zip(live, live_rows):
                m.timed_fill(bitmask, row)
        for m, row in zip(live, live_rows):
            m.restrict(bitmask, row)
        for src, dst in copies:
            bitmask[dst].copy_(bitmask[src])
