"""`patternProperties` names read the same way by every check.

A `patternProperties` name is an ECMA-262 regex that `jsonschema` runs with
Python's `re` (`re.search`), and a backend with its own reading (regex_classes.py):
a name with `\\D`, `\\W`, `\\S` or `[^\\s]` let xgrammar and llguidance write the
key "k١" for `^k\\D$` (Python: ١ is a digit, so the key matches nothing and
`additionalProperties: false` refuses it), and a name with `\\d`, `\\w` or `\\s` let
llguidance write "k١" for `^k\\d$` as an *undeclared* key, with a value the
pattern's schema refuses.

Used for llguidance (xgrammar compiles these names loosely and outlines-core
ignores them: both refuse `patternProperties`).
`portable_pattern_names(node)` gives the backend each name with its classes as
both readings match them, so a key generated for a pattern matches it under
either. A key generated as undeclared may then still match a pattern as Python
or ECMA-262 reads it (it holds a character the readings dispute), so where a name
changed and the node generates undeclared keys, the node is closed to its
declared properties and patterns (its undeclared required names declared with the
`additionalProperties` schema): stricter, never wrong.

`pattern_name_issues(node)` lists what that cannot make exact: a declared or
required name that matches a pattern under one reading but not under the
portable one (the backend would skip the pattern's schema for it), and a node
whose undeclared keys other subschemas decide (`allOf`, `$ref`,
`unevaluatedProperties`, ...), where closing the node alone could refuse names
they declare.
"""
from __future__ import annotations

import re
from typing import Any

from formwork.grammar.regex_classes import portable_classes

# Keywords beside which a node's undeclared names are not its own to close.
_PARTS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas",
          "dependencies", "unevaluatedProperties")


def _names(node: dict) -> dict[str, str]:
    """{name as written: as both readings match it} for each `patternProperties` name."""
    pp = node.get("patternProperties")
    return {k: portable_classes(k) for k in pp} if isinstance(pp, dict) else {}


def _changed(node: dict) -> dict[str, str]:
    return {k: v for k, v in _names(node).items() if k != v}


def _opens_undeclared(node: dict) -> bool:
    return node.get("additionalProperties", True) is not False


def _search(pattern: str, name: str) -> bool | None:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return None                  # not Python's regex: other rules name it


def _listed_names(node: dict) -> list[str]:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    req = node.get("required") if isinstance(node.get("required"), list) else []
    return list(props) + [r for r in req if isinstance(r, str) and r not in props]


def pattern_name_issues(node: dict) -> list[tuple[str, str]]:
    changed = _changed(node)
    if not changed:
        return []
    for pattern, portable in changed.items():
        wide = portable_classes(pattern, either=True)
        for name in _listed_names(node):
            if _search(wide, name) and _search(portable, name) is False:
                return [("patternProperties", f"property {name!r} matches {pattern!r} as "
                                              "Python's re or ECMA-262 reads it, not as both do")]
    parts = [k for k in _PARTS if k in node]
    if _opens_undeclared(node) and parts:
        return [("patternProperties", f"{sorted(changed)[0]!r} reads differently under "
                                      f"ECMA-262 and Python's re, and {parts[0]} beside it "
                                      "decides which other names are allowed")]
    return []


def portable_pattern_names(node: dict) -> dict:
    """`node` as generated (module doc); unchanged when no name has a disputed class."""
    if not _changed(node):
        return node
    pp: dict[str, Any] = {}
    for name, schema in node["patternProperties"].items():
        key = portable_classes(name, json_string=True)     # names are JSON strings too
        pp[key] = {"allOf": [pp[key], schema]} if key in pp else schema
    out = node | {"patternProperties": pp}
    if not _opens_undeclared(node):
        return out
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    undeclared = [r for r in _listed_names(node)[len(props):]
                  if not any(_search(p, r) for p in pp)]
    return out | {"properties": props | {r: extra for r in undeclared},
                  "additionalProperties": False}
