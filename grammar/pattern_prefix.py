"""Anchored regex patterns that no string matches both of: their fixed leading
characters differ somewhere (used by the oneOf proofs and the branch rules)."""
from __future__ import annotations

from typing import Any

from formwork.grammar.regex_safety import has_top_level_alternation

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


def _atom(pattern: str, i: int) -> tuple[bool, str | None, int]:
    """(known, char, end) for the atom at `i`: known False ends the prefix; char
    None is "some character" (`.`, `\\d`, ...)."""
    c = pattern[i]
    if c == "\\" and i + 1 < len(pattern):
        e = pattern[i + 1]
        if e in "dDwWsS":
            return True, None, i + 2
        if e in _ESCAPES:
            return True, _ESCAPES[e], i + 2
        if not e.isalnum() and e != "_":
            return True, e, i + 2
        return False, None, i
    if c == ".":
        return True, None, i + 1
    if c in "()[]{}|^$*+?":
        return False, None, i
    return True, c, i + 1


def literal_prefix(pattern: Any) -> list[str | None] | None:
    """The characters every match of a `^`-anchored pattern starts with, one
    entry per code point (None: some character), or None if not provable."""
    if not isinstance(pattern, str) or not pattern.startswith("^") \
            or has_top_level_alternation(pattern):
        return None
    out: list[str | None] = []
    i = 1
    while i < len(pattern):
        known, char, end = _atom(pattern, i)
        if not known or pattern[end:end + 1] in ("*", "+", "?", "{"):
            break
        out.append(char)
        i = end
    return out


def patterns_disjoint(a: Any, b: Any) -> bool:
    """No string contains a match of both patterns (Python `re.search`)."""
    pa, pb = literal_prefix(a), literal_prefix(b)
    if pa is None or pb is None:
        return False
    return any(x is not None and y is not None and x != y for x, y in zip(pa, pb))
