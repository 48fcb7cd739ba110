"""Which backend enforces a constraint: checks that need no tokenizer.

`backend="auto"` tries, per constraint kind, the backends that can serve it in a
fixed order -- soundness first (a backend is tried only where it enforces every
keyword exactly, or refuses), then coverage, then speed -- and takes the first
that accepts. Orders (measured, see README "Structured outputs"):

- json, json_object: llguidance, xgrammar, outlines. llguidance's JSON compiler
  is exact where it accepts (patterns, lengths, string escapes) and refuses what
  it does not implement; xgrammar and outlines-core serve what it refuses, each
  behind formwork's own keyword rules.
- regex, choice: xgrammar, llguidance, outlines (all exact; xgrammar's regex
  dialect is the documented one, `\\d` = [0-9]).
- grammar: xgrammar (its EBNF is the documented dialect), then llguidance (Lark).
- structural_tag: xgrammar (its own format language), then llguidance (triggered
  tags with JSON schemas; serves the tool schemas xgrammar refuses, e.g. patterns).

When none accepts, the first backend's reason is raised, e.g. "unsupported JSON
Schema keyword 'uniqueItems' at $.properties.tags". Explicit backends are checked
the same way and never substituted.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from formwork.grammar.llguidance_backend import to_llguidance
from formwork.grammar.outlines_backend import to_regex
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.schemas.structured import StructuredOutputsParams

CHECKS: dict[str, Callable[[StructuredOutputsParams], Any]] = {
    "llguidance": to_llguidance, "xgrammar": to_xgrammar, "outlines": to_regex}
ALIASES = {"guidance": "llguidance"}   # vLLM's name
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "json": ("llguidance", "xgrammar", "outlines"),
    "json_object": ("llguidance", "xgrammar"),
    "regex": ("xgrammar", "llguidance", "outlines"),
    "choice": ("xgrammar", "llguidance", "outlines"),
    "grammar": ("xgrammar", "llguidance"),
    "structural_tag": ("xgrammar", "llguidance"),
}


def choose_backend(params: StructuredOutputsParams, default_backend: str = "auto") -> str:
    """Validate `params` and return the name of the backend that serves it;
    ValueError (UnsupportedSchemaError for JSON Schema keywords) if none can.

    `default_backend` replaces `params.backend == "auto"` when it is not "auto".
    """
    params.validate()
    name = params.backend if params.backend != "auto" else default_backend
    name = ALIASES.get(name, name)
    if name != "auto":
        if name not in CHECKS:
            raise ValueError(f"unknown grammar backend {name!r}; choose one of "
                             f"{['auto', *CHECKS]}")
        CHECKS[name](params)
        return name
    first_error: ValueError | None = None
    for candidate in AUTO_ORDER[params.kind()]:
        try:
            CHECKS[candidate](params)
            return candidate
        except ValueError as err:
            first_error = first_error or err
    assert first_error is not None
    raise first_error


def validate_params(params: StructuredOutputsParams) -> None:
    """Synchronous check for the gateway (a 400 before queueing): spec shape,
    JSON Schema meta-schema, unenforceable keywords, regex/grammar syntax."""
    choose_backend(params)
