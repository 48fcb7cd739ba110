"""Constraint spec of one request, mirroring vLLM's `structured_outputs`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from formwork.schemas.errors import ParamError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# "guidance" is vLLM's name for llguidance.
BACKENDS = ("auto", "llguidance", "xgrammar", "outlines", "guidance")
# where a request's grammar is: compiling, ready to constrain, or refused
GrammarStatus = Literal["pending", "ready", "failed"]


@dataclass(slots=True)
class GrammarStats:
    """The grammar manager's counts since start-up (grammar/manager.py `stats()`
    hands out a copy; the engine's EngineStats carries some of them across the
    process boundary)."""
    compiles: int = 0
    compile_failures: int = 0
    cache_hits: int = 0
    inflight_shared: int = 0
    compile_seconds: float = 0.0
    fill_calls: int = 0
    fill_seconds: float = 0.0
    jump_forward_tokens: int = 0
    budget_steered_steps: int = 0
    deferred_checks: int = 0      # picks made without the mask, then checked
    deferred_refused: int = 0     # ... of which the grammar refused (picked again, masked)
    deferred_rescued: int = 0     # ... of which a greedy row's next best allowed token was found
    by_backend: dict[str, int] = field(default_factory=dict)
    cache_size: int = 0


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Exactly one of the constraint kinds must be set.

    json:           a JSON Schema (dict or JSON string)
    json_object:    True -> any JSON object
    regex:          a regular expression the whole output must match
    choice:         the output is exactly one of these strings
    grammar:        an EBNF (GBNF / xgrammar EBNF) grammar with a `root` rule
    structural_tag: free text with tagged, constrained segments; a dict
                    {"triggers": [...], "structures": [{"begin", "schema", "end"}]}
                    or xgrammar's structural-tag format dict.
    whitespace:     "compact" (no optional whitespace in JSON) or "flexible"
                    (at most `max_whitespace` whitespace chars in a run).
    whitespace_pattern: vLLM's: a regex for the whitespace between JSON tokens
                    (replaces `whitespace`); it may only match JSON whitespace
                    (space, \t, \n, \r). llguidance and outlines take it;
                    xgrammar refuses it.
    backend:        "auto" (per kind, the first backend that enforces the
                    constraint exactly: grammar/selection.py), "llguidance"
                    (alias "guidance"), "xgrammar" or "outlines".
    additional_properties: "declared" (default: an object schema that lists
                    `properties` but says nothing about others generates only
                    the declared ones, as OpenAI strict mode and vLLM's default
                    do) or "schema" (generate whatever the schema allows,
                    undeclared properties included; llguidance only).
    budget_aware:   close the output before max_tokens (or the context) cuts it:
                    in its last tokens the mask is narrowed to a short path that
                    completes it (grammar/budget.py); finish_reason stays "length".
                    None (default): the server's default, on for JSON (schemas,
                    json_object, structural tags: tool calls under tool_choice
                    "auto"; `--no-budget-aware` turns it off). Not part of the grammar.
    reasoning_end:  a reasoning model's end-of-thinking tag (e.g. "</think>"), one
                    token of the vocabulary: the output is free text (never the
                    end-of-sequence token) up to that token, and the constraint
                    applies to what follows it (grammar/reasoning_matcher.py). Set
                    by `formwork serve --reasoning-parser`; None: constrained from
                    the first token. Not part of the grammar.
    disable_any_whitespace, disable_additional_properties, disable_fallback:
                    vLLM's spellings, taken so that vLLM code runs unchanged:
                    True sets whitespace="compact" / additional_properties=
                    "declared" (the default) / nothing (formwork never falls back
                    from a named backend). They are folded in at construction and
                    read False afterwards.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    whitespace: Literal["compact", "flexible"] = "flexible"
    max_whitespace: int = 2
    whitespace_pattern: str | None = None
    backend: str = "auto"
    additional_properties: Literal["declared", "schema"] = "declared"
    budget_aware: bool | None = None
    reasoning_end: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        if self.json is True:     # the schema `true` accepts any value, as `{}` does;
            self.json = {}        # the wire type (dict | str) has no bool
        if self.disable_any_whitespace:
            self.whitespace = "compact"
        if self.disable_additional_properties:
            self.additional_properties = "declared"
        self.disable_any_whitespace = self.disable_additional_properties = False
        self.disable_fallback = False

    def kind(self) -> str:
        set_kinds = [k for k in KINDS if is_set(k, getattr(self, k))]
        if len(set_kinds) != 1:
            raise ParamError(
                "structured_outputs", "exactly one of "
                f"{', '.join(KINDS)} must be set (got {set_kinds or 'none'})")
        return set_kinds[0]

    def spec(self) -> Any:
        """The constraint value of `kind()`, JSON strings parsed."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind in ("json", "structural_tag") and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ParamError(f"structured_outputs.{kind}", f"not valid JSON: {e}") from None
        if kind == "json" and value is True:
            return {}
        return value

    def validate(self) -> None:
        kind = self.kind()
        if self.backend not in BACKENDS:
            raise ParamError(
                "structured_outputs.backend", f"must be one of {BACKENDS}, got {self.backend!r}")
        if self.whitespace not in ("compact", "flexible"):
            raise ParamError("structured_outputs.whitespace", "must be 'compact' or 'flexible'")
        if self.additional_properties not in ("declared", "schema"):
            raise ParamError("structured_outputs.additional_properties", "must be 'declared' or 'schema'")
        if self.reasoning_end is not None and not (
                isinstance(self.reasoning_end, str) and self.reasoning_end.strip()):
            raise ParamError("structured_outputs.reasoning_end", "must be a non-empty tag")
        if not 0 <= self.max_whitespace <= 64:
            raise ParamError("structured_outputs.max_whitespace", "must be in [0, 64]")
        if self.whitespace_pattern is not None:
            if kind not in ("json", "json_object", "structural_tag"):
                raise ParamError("structured_outputs.whitespace_pattern", "applies to JSON "
                                 f"constraints only, not to {kind}")
            check_whitespace_pattern(self.whitespace_pattern)
        value = self.spec()
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise ParamError("structured_outputs.choice", "must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not value.strip():
            raise ParamError(f"structured_outputs.{kind}", "must be a non-empty string")
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise ParamError("structured_outputs.json", "a JSON Schema must be an object")
        if kind == "json" and value is False:
            raise ParamError("structured_outputs.json", FALSE_SCHEMA)

    def cache_key(self) -> str:
        """Canonical text of the spec: equal constraints share a compiled grammar."""
        kind = self.kind()
        value = self.spec()
        return json.dumps(
            [kind, value, self.whitespace, self.max_whitespace, self.backend,
             self.additional_properties, self.whitespace_pattern],
            sort_keys=True, separators=(",", ":"))


def reasoning_end_id(tokenizer, tag: str) -> int | None:
    """The id of `reasoning_end` when the tokenizer writes it as one token, else None
    (the gateway asks before setting it, the grammar manager to build the matcher)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


# What a whitespace pattern may be made of: JSON's four whitespace characters
# (literal or escaped), groups, alternation, classes of those characters (no
# ranges, no negation), quantifiers after an atom. Anything else could admit a
# character that is not JSON (inside a class even `|` or `*` is a literal).
_WS_CHAR = re.compile(r"[ \t\n\r]|\\[ ntr]|\\x(?:20|09|0[aAdD])|\\u00(?:20|09|0[aAdD])")
_WS_META = re.compile(r"\(\?:|[(|*+?]")
_WS_COUNT = re.compile(r"\{\d+(?:,\d*)?\}")


FALSE_SCHEMA = ("the schema `false` accepts no value, so no output can satisfy it; "
                "pass an object schema ({} for any JSON value)")


def is_set(kind: str, value: Any) -> bool:
    """Whether a constraint field holds a constraint: `json_object: false` is vLLM's
    "not set", but `json: false` is a JSON Schema (one that accepts nothing)."""
    return value is not None and (value is not False or kind == "json")


def check_whitespace_pattern(pattern: str) -> None:
    """ValueError unless `pattern` is a regex that matches JSON whitespace only."""
    pos, in_class, class_len, after_atom = 0, False, 0, False
    while pos < len(pattern):
        if m := _WS_CHAR.match(pattern, pos):
            pos, class_len, after_atom = m.end(), class_len + 1, not in_class
            continue
        c = pattern[pos]
        if in_class and c == "]" and class_len:
            pos, in_class, after_atom = pos + 1, False, True
            continue
        if not in_class:
            if c == "[":
                pos, in_class, class_len = pos + 1, True, 0
                continue
            if c == ")":
                pos, after_atom = pos + 1, True
                continue
            if m := _WS_META.match(pattern, pos):
                pos, after_atom = m.end(), False
                continue
            if after_atom and (m := _WS_COUNT.match(pattern, pos)):
                pos, after_atom = m.end(), False
                continue
        raise ParamError(
            "structured_outputs.whitespace_pattern", f"{pattern!r} may match more than JSON "
            f"whitespace (at {pattern[pos:pos + 8]!r}); use only space, \\t, \\n, \\r "
            "(or \\x20, \\x09, \\x0a, \\x0d), classes of them, groups, | and "
            "quantifiers, e.g. '[ \\n]{0,4}'")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ParamError("structured_outputs.whitespace_pattern", f"not a valid regex: {e}") from None
