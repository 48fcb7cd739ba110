"""JSON text that stays on one line for every line reader.

Server-sent events and JSONL put one JSON value per line. `json.dumps(...,
ensure_ascii=False)` escapes the C0 controls but leaves U+0085 (NEL), U+2028 and
U+2029 raw, and readers that split with `str.splitlines()` (httpx's
`iter_lines()`, so httpx-sse; `text.splitlines()` over a JSONL file) break a line
at them: a model that writes one (or a schema's enum value that holds one) cut a
stream event in two for those clients. Escaping them is exact (inside a JSON
string `\\u2028` is the same character) and can only happen inside strings, as
JSON's own whitespace is none of them. Other non-ASCII text stays UTF-8.
"""
from __future__ import annotations

import json
from typing import Any

_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps_line(value: Any, **kwargs) -> str:
    """`json.dumps(value, ensure_ascii=False, **kwargs)` with the characters that
    `str.splitlines()` breaks on escaped: the text is one line for any reader."""
    return json.dumps(value, ensure_ascii=False, **kwargs).translate(_LINE_BREAKERS)
