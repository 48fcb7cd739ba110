"""Re-validation of finished constrained outputs (the `formwork` extension field).

The grammar guarantees what it can; the gateway says, per choice, whether the text
that reaches the client actually validates: a stop string or max_tokens may cut
it, and a backend bug would show here first.

constraint         | checked with
-------------------|--------------------------------------------------------------
json (a schema)    | jsonschema, the draft its `$schema` names (default 2020-12),
                   | formats checked (every backend enforces the formats it accepts)
json_object        | parses as a JSON object
regex              | Python `re.fullmatch`; "unchecked" if `re` cannot compile it
choice             | equality with one of the choices
tools ("auto")     | each <tool_call>'s arguments against its tool's parameters
                   | (the "required" / named tool constraints are JSON schemas);
                   | a custom tool's raw input against its Lark grammar
grammar (Lark)     | llguidance's parser over the text's bytes (a byte vocabulary)
grammar (EBNF),    | "unchecked" (valid null): xgrammar served it, and no other
other structural   | parser reads its dialect alike
tags               |

Verdict.valid: True, False (`error` says why, naming a stop-string or max_tokens
cut), or None (unchecked). Validators are compiled once per schema text (LRU).

Patterns come from the client and the check runs on the event loop, so no regex is
matched with Python's `re`, which backtracks without bound (`(a|aa)+b` over 40 a's
held the loop for 18 s: every other request froze). Regex constraints and JSON
Schema `pattern` / `patternProperties` (and `additionalProperties` beside them)
match with the `regex` package (mrab's; VERSION0, `re`'s syntax), which takes a
timeout: a match past REGEX_TIMEOUT_S leaves the choice unchecked, and the pattern
is remembered so that the next check of it costs nothing. Its \w \d \s differ
from `re`'s (combining marks are word characters there), so they, and \b \B, are
spelled out as `re` reads them first (grammar/regex_classes.re_classes); `re` still
decides which patterns are checkable at all (one it cannot compile: unchecked, as
before).
"""
from __future__ import annotations

import contextvars
import json
import math
import re
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

from formwork.gateway.tool_parser import parse_tool_output
from formwork.gateway.tools import ToolMode, parameters_schema, tag_answer
from formwork.grammar.regex_classes import re_classes
from formwork.grammar.schema_walk import validator_class
from formwork.schemas.openai import CUSTOM_INPUT, OutputCheck
from formwork.schemas.structured import StructuredOutputsParams

_VALIDATOR_CACHE_SIZE = 256
_MAX_ERROR_CHARS = 300
REGEX_TIMEOUT_S = 0.1          # one match
CHECK_REGEX_BUDGET_S = 0.3     # all of one choice's matches (many patterns, each just under)
# the current check's deadline, set at its first match (compiling a pattern, or
# reading re's classes the first time, is not matching time)
_deadline: contextvars.ContextVar[list[float | None] | None] = contextvars.ContextVar(
    "regex_deadline", default=None)
_SLOW_PATTERNS_KEPT = 1024
_slow_patterns: dict[str, None] = {}      # patterns that ran past the timeout (insertion order)


class _Unchecked(Exception):
    """A pattern the check cannot match in bounded time (or at all)."""


_LARK_MATCHERS_KEPT = 256
# grammar text -> (its byte-level matcher, None) or (None, why it does not compile), LRU
_lark_matchers: dict[str, tuple[Any, str | None]] = {}
_lark_lock = threading.Lock()


def lark_grammars(params: StructuredOutputsParams | None, mode: ToolMode | None) -> list[str]:
    """The Lark grammars `check_output` parses outputs of `params` with: a Lark
    `grammar` constraint (a named Lark custom tool's among them) and the raw Lark
    custom tools that may be called. The server compiles them with `prepare_lark`
    in a worker thread before the request runs: the check itself never compiles."""
    if params is None:
        return []
    out = []
    if params.kind() == "grammar" and "::=" not in params.spec():     # Lark, not EBNF
        out.append(params.spec())
    if mode is not None and mode.kind != "named":
        out += [mode.custom[n].definition for n in sorted(mode.raw_callable)]
    return [g for g in out if "<[" not in g]


def prepare_lark(grammars: list[str]) -> None:
    """Compile (and keep) the byte-level matchers of `grammars`: off the event loop
    (a large grammar takes a while: 0.16 s for 100 KB), bounded by llguidance's fuel."""
    for grammar in grammars:
        _lark_matcher(grammar, build=True)


def _lark_matcher(grammar: str, build: bool) -> tuple[Any, str | None] | None:
    with _lark_lock:
        kept = _lark_matchers.pop(grammar, None)
        if kept is not None:
            _lark_matchers[grammar] = kept          # most recently used last
            return kept
    if not build:
        return None
    import llguidance as llg

    from formwork.grammar.byte_vocab import byte_tokenizer
    from formwork.grammar.llguidance_grammar import LIMITS
    try:
        m = llg.LLMatcher(byte_tokenizer(), llg.LLMatcher.grammar_from_lark(grammar), log_level=0,
                          limits=llg.LLParserLimits(**LIMITS))
        kept = (None, _short(m.get_error())) if m.is_error() else (m, None)
    except Exception as e:      # never fail a request over its check: unchecked then
        kept = (None, _short(f"{type(e).__name__}: {e}"))
    with _lark_lock:
        _lark_matchers[grammar] = kept
        while len(_lark_matchers) > _LARK_MATCHERS_KEPT:
            del _lark_matchers[next(iter(_lark_matchers))]
    return kept


def _lark_error(grammar: str, text: str) -> str | None:
    """Whether `text` is in a Lark grammar's language (llguidance's dialect, as the
    backend served it), parsed byte by byte with the matcher `prepare_lark` compiled;
    None when it is. Unchecked: a grammar not prepared (or evicted since), one that
    does not compile here, one naming special tokens (`<|im_start|>`, `<[id]>`: the
    text leaves them out)."""
    if "<[" in grammar:      # token ids (`<[128010]>`): a model's tokens, not bytes
        raise _Unchecked("the grammar names token ids")
    kept = _lark_matcher(grammar, build=False)
    if kept is None:
        raise _Unchecked("the grammar was not compiled for the check")
    m, error = kept
    if m is None:
        raise _Unchecked(f"the grammar does not compile here: {error}")
    m.reset()
    data = text.encode()
    taken = m.try_consume_tokens(list(data))        # leaves no error state behind
    if taken < len(data):
        return (f"does not follow the grammar at byte {taken} "
                f"({_short(repr(data[max(0, taken - 20):taken + 1]))})")
    return None if m.is_accepting() else "ends before the grammar allows"


@dataclass(frozen=True, slots=True)
class Verdict:
    valid: bool | None
    error: str | None = None

    @property
    def result(self) -> str:
        """The metrics label: "valid" | "invalid" | "unchecked"."""
        return {True: "valid", False: "invalid", None: "unchecked"}[self.valid]

    def field(self) -> OutputCheck:
        """The `formwork` extension field of a choice."""
        return OutputCheck(valid=self.valid, error=self.error)


# extension fields of a choice that are left out of the JSON when null: `formwork`
# (unconstrained), vLLM's token ids (return_token_ids not asked for)
_UNSET_KEYS = ("formwork", "token_ids", "prompt_token_ids")


def drop_unset(choices: list[dict]) -> list[dict]:
    """Choices as JSON without the extension keys that are null (_UNSET_KEYS)."""
    for c in choices:
        for key in _UNSET_KEYS:
            if c.get(key, 0) is None:
                del c[key]
    return choices


@lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _validator(schema_text: str):
    schema = json.loads(schema_text)
    cls = validator_class(schema)
    return _bounded(cls)(schema, format_checker=_format_checker(cls))


@lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _bounded_regex(pattern: str) -> regex.Pattern | None:
    if _regex(pattern) is None:          # `re` cannot: unchecked, as before
        return None
    spelled = re_classes(pattern)
    if spelled is None:                  # an ASCII or locale flag: not re's Unicode sets
        return None
    try:
        with warnings.catch_warnings():      # "possible nested set": V1 syntax, not used
            warnings.simplefilter("ignore", FutureWarning)
            return regex.compile(spelled, flags=regex.VERSION0)
    except (regex.error, OverflowError, RecursionError):
        return None


def warm() -> None:
    """`re`'s class sets, read from `re` once (~0.7 s): at start-up, in a thread,
    not in the first check of a pattern with a class, on the event loop."""
    re_classes(r"\w\d\s")


def _matches(pattern: str, text: str, full: bool = False) -> bool:
    """re.search (or fullmatch) semantics, bounded by REGEX_TIMEOUT_S; _Unchecked
    where that runs out (now or on an earlier check) or the pattern does not compile."""
    if pattern in _slow_patterns:
        raise _Unchecked(f"matching {_short(pattern)!r} took longer than {REGEX_TIMEOUT_S} s "
                         "(backtracking) on an earlier check")
    compiled = _bounded_regex(pattern)
    if compiled is None:
        raise _Unchecked(f"the regex {_short(pattern)!r} does not compile here")
    box, now = _deadline.get(), time.monotonic()
    if box is not None and box[0] is None:
        box[0] = now + CHECK_REGEX_BUDGET_S
    left = math.inf if box is None else box[0] - now
    if left <= 0:
        raise _Unchecked(f"its patterns took longer than {CHECK_REGEX_BUDGET_S} s in all")
    try:
        match = (compiled.fullmatch if full else compiled.search)(
            text, timeout=min(REGEX_TIMEOUT_S, left))
    except TimeoutError:
        if left < REGEX_TIMEOUT_S:       # the check's budget ran out, not this pattern's
            raise _Unchecked(f"its patterns took longer than {CHECK_REGEX_BUDGET_S} s "
                             "in all") from None
        _slow_patterns[pattern] = None
        while len(_slow_patterns) > _SLOW_PATTERNS_KEPT:
            del _slow_patterns[next(iter(_slow_patterns))]
        raise _Unchecked(f"matching {_short(pattern)!r} took longer than {REGEX_TIMEOUT_S} s "
                         "(backtracking)") from None
    return match is not None


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _matches(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if _matches(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


@lru_cache(maxsize=8)
def _bounded(cls) -> type:
    """`cls` with the keywords that match regexes (jsonschema calls `re.search`)
    matching them with _matches instead."""
    unbounded_additional = cls.VALIDATORS.get("additionalProperties")

    def additional_properties(validator, extra, instance, schema):
        if "patternProperties" not in schema or not validator.is_type(instance, "object"):
            if unbounded_additional is not None:     # no regex involved
                yield from unbounded_additional(validator, extra, instance, schema)
            return
        declared = schema.get("properties", {})
        extras = sorted(name for name in instance if name not in declared and not any(
            _matches(p, name) for p in schema["patternProperties"]))
        if validator.is_type(extra, "object"):
            for name in extras:
                yield from validator.descend(instance[name], extra, path=name)
        elif not extra and extras:
            patterns = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(f"{', '.join(repr(e) for e in extras)} {verb} not match any of "
                                  f"the regexes: {patterns}")

    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties,
                "additionalProperties": additional_properties}
    return jsonschema.validators.extend(
        cls, {k: f for k, f in keywords.items() if k in cls.VALIDATORS})


# An IRI that is also a URI is valid; the backends generate `iri` as `uri` (narrowed).
# jsonschema's IRI checker (rfc3987-syntax, an Earley parser) takes ~7 ms a string
# here, its URI checker ~4 us: the URI check comes first.
_URI_FIRST = {"iri": "uri", "iri-reference": "uri-reference"}


@lru_cache(maxsize=8)
def _format_checker(cls) -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for slow, fast in _URI_FIRST.items():
        if slow in checker.checkers and fast in checker.checkers:
            checker.checkers[slow] = (_either(checker.checkers[fast], checker.checkers[slow]),
                                      checker.checkers[slow][1])
    return checker


def _either(first: tuple, second: tuple):
    def check(instance: object) -> bool:
        try:
            if first[0](instance):
                return True
        except first[1]:
            pass
        return second[0](instance)
    return check


@lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _regex(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError):
        return None


def _short(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def schema_error(schema: Any, value: Any) -> str | None:
    """The first JSON Schema error of `value` (with its JSON path), None if it validates."""
    if schema is True or schema == {}:
        return None
    err = next(iter(_validator(json.dumps(schema, sort_keys=True)).iter_errors(value)), None)
    return None if err is None else _short(f"{err.json_path}: {err.message}")


def _json_error(text: str, schema: Any) -> str | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return f"not valid JSON: {e}"
    if schema is None:
        return None if isinstance(value, dict) else "not a JSON object"
    return schema_error(schema, value)


def _calls_error(mode: ToolMode, text: str, answer: Any) -> str | None:
    """Tool-call output ("auto"): every call's arguments against its tool's schema;
    without calls, the answer format's schema (if any) on the content."""
    content, calls = parse_tool_output(mode, text)
    if not calls:
        if content and "<tool_call>" in content:
            return "a <tool_call> segment is not a valid call"
        return _json_error(text, answer) if answer is not None else None
    tools = {t.name: t for t in mode.tools}
    for i, call in enumerate(calls):
        fn = tools.get(call.name)
        if fn is None:
            return f"tool_calls[{i}]: unknown function {call.name!r}"
        if call.type == "custom" and call.name in mode.raw:     # the input under its Lark
            error = _lark_error(mode.custom[call.name].definition, call.custom.input)
            if error is not None:
                return f"tool_calls[{i}] ({fn.name}) input: {error}"
            continue
        # a custom tool's input is checked as the one argument it was generated as
        arguments = call.function.arguments if call.type == "function" else \
            json.dumps({CUSTOM_INPUT: call.custom.input})
        error = _json_error(arguments, parameters_schema(fn))
        if error is not None:
            return f"tool_calls[{i}] ({fn.name}) arguments: {error}"
    return None


def _error(params: StructuredOutputsParams, mode: ToolMode | None,
           text: str) -> tuple[bool, str | None]:
    """(checked, error or None) of `text` under `params`."""
    kind, spec = params.kind(), params.spec()
    if kind == "json":
        return True, _json_error(text, spec)
    if kind == "json_object":
        return True, _json_error(text, None)
    if kind == "choice":
        return True, None if text in spec else "not one of the choices"
    if kind == "regex":
        if _regex(spec) is None:
            return False, None
        return True, None if _matches(spec, text, full=True) else "does not match the regex"
    if kind == "grammar" and "::=" not in spec:        # Lark (an EBNF has ::= rules)
        return True, _lark_error(spec, text)
    if kind == "structural_tag" and mode is not None and mode.tagged and mode.tools:
        answer = tag_answer(spec)
        return True, _calls_error(mode, text, None if answer is True else answer)
    return False, None


def check_output(params: StructuredOutputsParams | None, mode: ToolMode | None, text: str,
                 finish_reason: str | None, stop_reason: int | str | None) -> Verdict | None:
    """The verdict on one finished choice; None when it was unconstrained or aborted."""
    if params is None or finish_reason in (None, "abort"):
        return None
    if finish_reason == "error":
        return Verdict(False, "generation failed before the output was complete")
    token = _deadline.set([None])
    try:
        checked, error = _error(params, mode, text)
    except _Unchecked as e:
        return Verdict(None, f"could not be checked: {e}")
    except Exception as e:      # e.g. a $ref jsonschema cannot resolve: never fail the reply
        return Verdict(None, _short(f"could not be checked: {type(e).__name__}: {e}"))
    finally:
        _deadline.reset(token)
    if not checked:
        return Verdict(None)
    if error is None:
        return Verdict(True)
    if finish_reason == "length":
        error = f"cut by max_tokens (finish_reason length): {error}"
    elif isinstance(stop_reason, str):
        error = f"cut by stop string {stop_reason!r}: {error}"
    elif stop_reason is not None:
        error = f"cut by stop token id {stop_reason}: {error}"
    return Verdict(False, error)
