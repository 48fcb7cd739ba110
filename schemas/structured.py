"""Constraint spec of one request, mirroring vLLM's `structured_outputs`."""
from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# "guidance" is vLLM's name for llguidance.
BACKENDS = ("auto", "llguidance", "xgrammar", "outlines", "guidance")


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
    backend:        "auto" (per kind, the first backend that enforces the
                    constraint exactly: grammar/selection.py), "llguidance"
                    (alias "guidance"), "xgrammar" or "outlines".
    additional_properties: "declared" (default: an object schema that lists
                    `properties` but says nothing about others generates only
                    the declared ones, as OpenAI strict mode and vLLM's default
                    do) or "schema" (generate whatever the schema allows,
                    undeclared properties included; llguidance only).
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    whitespace: Literal["compact", "flexible"] = "flexible"
    max_whitespace: int = 2
    backend: str = "auto"
    additional_properties: Literal["declared", "schema"] = "declared"

    def kind(self) -> str:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of "
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
                raise ValueError(f"structured_outputs.{kind}: not valid JSON: {e}") from None
        return value

    def validate(self) -> None:
        kind = self.kind()
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs.backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.whitespace not in ("compact", "flexible"):
            raise ValueError("structured_outputs.whitespace: must be 'compact' or 'flexible'")
        if self.additional_properties not in ("declared", "schema"):
            raise ValueError("structured_outputs.additional_properties: must be 'declared' or 'schema'")
        if not 0 <= self.max_whitespace <= 64:
            raise ValueError("structured_outputs.max_whitespace: must be in [0, 64]")
        value = self.spec()
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not value.strip():
            raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON Schema must be an object")

    def cache_key(self) -> str:
        """Canonical text of the spec: equal constraints share a compiled grammar."""
        kind = self.kind()
        value = self.spec()
        return json.dumps(
            [kind, value, self.whitespace, self.max_whitespace, self.backend,
             self.additional_properties],
            sort_keys=True, separators=(",", ":"))
