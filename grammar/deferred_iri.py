"""jsonschema's IRI checker, loaded when an IRI is first checked instead of at import.

jsonschema (with its `format-nongpl` checkers, a dependency: the gateway re-validates
outputs with formats checked) imports `rfc3987_syntax` when it is installed, and that
package builds 38 Lark grammars at import: ~1 s of every process that imports
jsonschema (the gateway, each engine, the CLI), the largest part of a server's start
on a 2-core box. The IRI checker is rarely asked for (an `iri` / `iri-reference`
format) and costs ~7 ms a string once loaded.

`defer()` puts a stand-in module under that name before jsonschema is imported: its
`is_valid_syntax` (the one name jsonschema takes) and any other attribute load the
real package on first use, which then replaces the stand-in in `sys.modules`, so
checking is unchanged (tests/test_output_check.py checks an IRI through it). Nothing
is done when the package is absent or already imported, or when jsonschema is.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

NAME = "rfc3987_syntax"


class _StandIn(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):     # `__file__`, `__path__`: asked by whoever walks sys.modules
            raise AttributeError(attr)
        return getattr(_load(), attr)


def _load() -> types.ModuleType:
    if isinstance(sys.modules.get(NAME), _StandIn):
        del sys.modules[NAME]
    return importlib.import_module(NAME)


def is_valid_syntax(term: str, value: str) -> bool:
    return _load().is_valid_syntax(term, value)


def defer() -> None:
    if NAME in sys.modules or "jsonschema" in sys.modules:
        return
    try:
        if importlib.util.find_spec(NAME) is None:
            return
    except (ImportError, ValueError):
        return
    stand_in = _StandIn(NAME, "stand-in until first use: formwork.grammar.deferred_iri")
    stand_in.is_valid_syntax = is_valid_syntax
    sys.modules[NAME] = stand_in
