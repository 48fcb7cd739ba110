"""Request checks the gateway runs before queueing (to answer 400, not fail
later). The gateway imports core, never grammar: this is its door."""
from __future__ import annotations

from formwork.schemas.structured import StructuredOutputsParams


def validate_structured(params: StructuredOutputsParams, default_backend: str = "auto") -> None:
    """Raises ValueError naming the problem (keyword + JSON path for schemas,
    syntax errors for regex/grammar). Compiles no grammar against a tokenizer."""
    from formwork.grammar.selection import choose_backend
    choose_backend(params, default_backend)
