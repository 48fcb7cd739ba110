"""Fold minLength/maxLength into a `pattern` that counts characters exactly.

xgrammar drops string lengths next to `pattern`. When the pattern is a
`^...$`-anchored sequence of single-character atoms (a literal, an escape, `.`,
a class, or a group of such atoms without alternation), each with an optional
quantifier, every match has length sum(width_i * count_i) in code points. If
at most one atom's count varies, the length bounds become bounds on that count,
and `^A{m,n}$` alone means exactly "matches and has an admissible length".
Anything else (alternation, nested groups, lookarounds, backreferences, two
variable atoms, no anchors, counts above MAX_FOLDED_COUNT) is left alone: the
caller keeps the lengths flagged.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# xgrammar expands a counted repetition: measured on 2 cores, `[^<>]{0,1024}`
# compiles in 0.7 s against a 49k vocabulary, `{0,2048}` in 2.9 s, `{0,4096}` in 13 s.
MAX_FOLDED_COUNT = 1024
_QUANT = re.compile(r"\*|\+|\?|\{(\d+)\}|\{(\d+),(\d*)\}")
_CLASS_ESCAPES = frozenset("dDwWsS")
_CHAR_ESCAPES = frozenset("ntrfv")


# One JSON string character that needs no escape (RFC 8259): not a quote, a
# backslash or a control character.
JSON_PLAIN_CHAR = r'[^"\\\x00-\x1f]'
_PLAIN_LENGTH = re.compile(r"\^" + re.escape(JSON_PLAIN_CHAR) + r"\{\d+,\d*\}\$")


def plain_length_pattern(lo: int, hi: int | None) -> str:
    """`^[plain]{lo,hi}$`: lo..hi characters, none of which needs escaping."""
    return f"^{JSON_PLAIN_CHAR}{{{lo},{'' if hi is None else hi}}}$"


def is_plain_length_pattern(pattern) -> bool:
    """True for exactly the patterns `plain_length_pattern` writes."""
    return isinstance(pattern, str) and _PLAIN_LENGTH.fullmatch(pattern) is not None


@dataclass(frozen=True, slots=True)
class _Atom:
    text: str          # the atom as written, quantifier excluded
    width: int         # code points one repetition matches
    lo: int
    hi: int | None     # None: unbounded


def _single(p: str, i: int) -> int | None:
    """End of the one-character atom starting at p[i], or None."""
    c = p[i]
    if c == "\\":
        if i + 1 >= len(p):
            return None
        e = p[i + 1]
        ok = e in _CLASS_ESCAPES or e in _CHAR_ESCAPES or not (e.isalnum() or e == "_")
        return i + 2 if ok else None
    if c == "[":
        j = i + 1
        j += 1 if p[j:j + 1] == "^" else 0
        j += 1 if p[j:j + 1] == "]" else 0
        while j < len(p) and p[j] != "]":
            if p[j] == "[":            # nested sets / set operations: not handled
                return None
            j += 2 if p[j] == "\\" else 1
        return j + 1 if j < len(p) else None
    return None if c in "()|{}*+?^$" else i + 1


def _group(p: str, i: int) -> tuple[int, int] | None:
    """(end, width) of `(...)` / `(?:...)` made of single-character atoms."""
    j = i + 3 if p.startswith("(?:", i) else i + 1
    if p.startswith("(?", i) and j == i + 1:
        return None                    # lookaround, named group, flags
    width = 0
    while j < len(p) and p[j] != ")":
        end = _single(p, j)
        if end is None:
            return None
        width, j = width + 1, end
    return (j + 1, width) if j < len(p) and width else None


def parse_atoms(pattern: str) -> list[_Atom] | None:
    """The atoms of an anchored `^...$` pattern, or None if not of that shape."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        return None
    body, i, atoms = pattern[1:-1], 0, []
    while i < len(body):
        if body[i] == "(":
            g = _group(body, i)
            if g is None:
                return None
            end, width = g
        else:
            end, width = _single(body, i), 1
            if end is None:
                return None
        m = _QUANT.match(body, end)
        lo, hi, stop = 1, 1, end
        if m:
            q, stop = m.group(0), m.end()
            if q in ("*", "+", "?"):
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q]
            elif m.group(1) is not None:
                lo = hi = int(m.group(1))
            else:
                lo, hi = int(m.group(2)), int(m.group(3)) if m.group(3) else None
            if hi is not None and hi < lo:
                return None
            if body[stop:stop + 1] == "?":          # lazy: same set of full matches
                stop += 1
        if body[stop:stop + 1] in ("*", "+", "?", "{"):
            return None                             # possessive or stacked quantifier
        atoms.append(_Atom(body[i:end], width, lo, hi))
        i = stop
    return atoms


def _quantifier(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"{{{lo},}}"
    return "" if lo == hi == 1 else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def fold_lengths(pattern: str, min_len: int | None, max_len: int | None) -> str | None:
    """A pattern matching exactly the strings that match `pattern` and have
    min_len <= length <= max_len (code points), or None if not expressible.
    The result may be `pattern` itself when the bounds are already implied."""
    atoms = parse_atoms(pattern)
    if atoms is None:
        return None
    lo_min = min_len or 0
    lo_total = sum(a.width * a.lo for a in atoms)
    hi_total = None if any(a.hi is None for a in atoms) else \
        sum(a.width * a.hi for a in atoms)          # type: ignore[operator]
    implied_max = max_len is None or (hi_total is not None and hi_total <= max_len)
    if lo_total >= lo_min and implied_max:
        return pattern
    variable = [k for k, a in enumerate(atoms) if a.lo != a.hi]
    if len(variable) != 1:
        return None
    k = variable[0]
    a = atoms[k]
    fixed = lo_total - a.width * a.lo
    lo = max(a.lo, math.ceil((lo_min - fixed) / a.width))
    hi = a.hi
    if max_len is not None:
        cap = (max_len - fixed) // a.width
        hi = cap if hi is None else min(hi, cap)
    if hi is not None and (hi < lo or hi < 0):
        return None                                  # no string fits: leave it flagged
    if max(lo, hi or 0) > MAX_FOLDED_COUNT:
        return None
    parts = [x.text + _quantifier(x.lo, x.hi) for x in atoms]
    parts[k] = a.text + _quantifier(lo, hi)
    return "^" + "".join(parts) + "$"
