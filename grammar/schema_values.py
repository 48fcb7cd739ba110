"""`enum` / `const` numbers a backend would write as another number.

A backend writes an enum or const value as JSON text it made from the schema's
number, and that text must parse back to a value jsonschema calls equal. Not so
for every number (measured, llguidance 1.9.1, outlines-core 0.2.14):
- llguidance reads numbers as 64-bit floats with a parser that can be one unit
  in the last place off (0.9619009378982257 is written 0.9619009378982256,
  123456789.12345679 as 123456789.1234568), rounds integers past 2^53
  (9007199254740993 -> 9007199254740992), and writes a large integral float as
  an integer (1e23 -> 100000000000000000000000, which is not the float 1e23);
  beside `type: integer` it reads the value as a 64-bit integer range, so 1e20
  was written 9223372036854775807, and a value below -2^63 crashed the process
  (SIGSEGV) as the lowest int64 ranges do (llguidance_grammar._refuse_int64_ranges):
  such values are refused without asking it;
- outlines-core reads them the same way (0.9619009378982257 -> ...256).
xgrammar writes the schema's own text. Which numbers a parser gets wrong is its
own business, so the backend itself is asked how it writes each one (a tiny
compile per distinct number, remembered) and the text is compared with the value
by `json.loads` and Python's `==`, as jsonschema compares enum members.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from formwork.grammar.schema_formats import is_number
from formwork.grammar.schema_walk import SchemaNode


def _numbers(value: Any) -> Iterator[int | float]:
    """The numbers inside an enum/const value (in arrays and objects too)."""
    if is_number(value):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)


def _trivial(v: int | float) -> bool:
    """Numbers every backend writes exactly: integers a double holds exactly."""
    return isinstance(v, int) and abs(v) <= 2 ** 53


# Integer-typed values llguidance reads as int64 must lie in this range (the bound
# of llguidance_grammar.LOWEST_BOUND; not imported: that module imports this one).
INT64_RANGE = (-(2 ** 63) + 1024, 2 ** 63 - 1)


def _llguidance_writes(v: int | float, types: Any = None) -> str | None:
    """The text llguidance's JSON compiler writes for `const: v` beside `type:
    types` (None: it cannot build it; its refusal is reported where the schema is
    compiled)."""
    import llguidance as llg

    from formwork.grammar.byte_vocab import byte_tokenizer
    schema: dict[str, Any] = {"const": v}
    if types is not None:
        schema["type"] = types
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        m = llg.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    except (ValueError, TypeError):
        return None
    if m.is_error():
        return None
    return m.compute_ff_bytes().decode("utf-8", errors="replace")


def _outlines_writes(v: int | float, types: Any = None) -> str | None:
    """The literal outlines-core's regex for `const: v` holds."""
    from outlines_core.json_schema import build_regex_from_schema
    try:
        regex = build_regex_from_schema(json.dumps({"const": v}))
    except Exception:          # its own refusal is reported where the schema is compiled
        return None
    return re.sub(r"\\(.)", r"\1", regex)


_WRITERS: dict[str, Callable[[int | float, Any], str | None]] = {
    "llguidance": _llguidance_writes, "outlines": _outlines_writes}


def written(v: int | float, backend: str, types: Any = None) -> str | None:
    """How `backend` writes the enum/const number `v` beside `type: types`
    (remembered per backend)."""
    return _written(json.dumps([v, types]), backend)


@functools.lru_cache(maxsize=4096)
def _written(key: str, backend: str) -> str | None:
    v, types = json.loads(key)          # a float's JSON text reads back as that float
    return _WRITERS[backend](v, types)


def _equal(text: str | None, v: int | float) -> bool:
    if text is None:
        return True            # not built here: the backend's own error decides
    try:
        back = json.loads(text)
    except ValueError:
        return False
    return is_number(back) and back == v


def _integer_typed(node: dict) -> bool:
    t = node.get("type")
    return t == "integer" or isinstance(t, list) and "integer" in t


def inexact_values(sn: SchemaNode, backend: str) -> list[tuple[str, str]]:
    """(keyword, detail) for the first enum/const number of this node that
    `backend` would write as another number."""
    node = sn.schema
    # llguidance intersects a value with the node's `type` (outlines-core's enum wins)
    typed = backend == "llguidance" and "type" in node
    for kw in ("const", "enum"):
        if kw not in node:
            continue
        values = [node[kw]] if kw == "const" else node[kw] if isinstance(node[kw], list) else []
        for value in values:
            top = is_number(value)
            for v in _numbers(value):
                if _trivial(v):
                    continue
                if top and typed and _integer_typed(node) and \
                        not INT64_RANGE[0] <= v <= INT64_RANGE[1]:
                    return [(kw, f"{backend} reads {json.dumps(v)} beside `type: integer` as "
                                 "a 64-bit integer, which cannot hold it")]
                text = written(v, backend, node["type"] if top and typed else None)
                if not _equal(text, v):
                    return [(kw, f"{backend} writes the number {json.dumps(v)} as {text}, "
                                 "another number (it reads it as a 64-bit float)")]
    return []
