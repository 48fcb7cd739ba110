"""Which backend enforces a constraint: checks that need no tokenizer.

`backend="auto"`: xgrammar if it enforces the constraint exactly, otherwise
outlines-core if it does, otherwise xgrammar's reason as a ValueError, e.g.
"unsupported JSON Schema keyword 'uniqueItems' at $.properties.tags".
Explicit backends are checked the same way and never substituted.
"""
from __future__ import annotations

from formwork.grammar.outlines_backend import to_regex
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.schemas.structured import StructuredOutputsParams

_CHECKS = {"xgrammar": to_xgrammar, "outlines": to_regex}
_OUTLINES_KINDS = ("json", "regex", "choice")


def choose_backend(params: StructuredOutputsParams, default_backend: str = "auto") -> str:
    """Validate `params` and return "xgrammar" or "outlines"; ValueError if neither fits.

    `default_backend` replaces `params.backend == "auto"` when it is not "auto".
    """
    params.validate()
    name = params.backend if params.backend != "auto" else default_backend
    if name != "auto":
        if name not in _CHECKS:
            raise ValueError(f"unknown grammar backend {name!r}")
        _CHECKS[name](params)
        return name
    try:
        to_xgrammar(params)
        return "xgrammar"
    except ValueError as xgrammar_error:
        if params.kind() not in _OUTLINES_KINDS:
            raise
        try:
            to_regex(params)
        except ValueError:
            raise xgrammar_error from None
        return "outlines"


def validate_params(params: StructuredOutputsParams) -> None:
    """Synchronous check for the gateway (a 400 before queueing): spec shape,
    JSON Schema meta-schema, unenforceable keywords, regex/grammar syntax."""
    choose_backend(params)
