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
                   | (the "required" / named tool constraints are JSON schemas)
grammar, other     | "unchecked" (valid null)
structural tags    |

Verdict.valid: True, False (`error` says why, naming a stop-string or max_tokens
cut), or None (unchecked). Validators are compiled once per schema text (LRU).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema

from formwork.gateway.tool_parser import parse_tool_output
from formwork.gateway.tools import ToolMode, parameters_schema, tag_answer
from formwork.grammar.schema_walk import validator_class
from formwork.schemas.openai import OutputCheck
from formwork.schemas.structured import StructuredOutputsParams

_VALIDATOR_CACHE_SIZE = 256
_MAX_ERROR_CHARS = 300


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


def drop_unset(choices: list[dict]) -> list[dict]:
    """Choices as JSON without a `formwork` key where it is null (unconstrained)."""
    for c in choices:
        if c.get("formwork", 0) is None:
            del c["formwork"]
    return choices


@lru_cache(maxsize=_VALIDATOR_CACHE_SIZE)
def _validator(schema_text: str):
    schema = json.loads(schema_text)
    cls = validator_class(schema)
    return cls(schema, format_checker=_format_checker(cls))


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
        fn = tools.get(call.function.name)
        if fn is None:
            return f"tool_calls[{i}]: unknown function {call.function.name!r}"
        error = _json_error(call.function.arguments, parameters_schema(fn))
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
        pattern = _regex(spec)
        if pattern is None:
            return False, None
        return True, None if pattern.fullmatch(text) else "does not match the regex"
    if kind == "structural_tag" and mode is not None and mode.kind == "auto" and mode.tools:
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
    try:
        checked, error = _error(params, mode, text)
    except Exception as e:      # e.g. a $ref jsonschema cannot resolve: never fail the reply
        return Verdict(None, _short(f"could not be checked: {type(e).__name__}: {e}"))
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
