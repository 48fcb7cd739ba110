"""Regex classes spelled out so that what a backend generates matches under every
reading a user's check may take.

A JSON Schema `pattern` is ECMA-262 (\\d = [0-9], \\s = its WhiteSpace and
LineTerminator list, `.` = not a line terminator); Python's `re`, which
`jsonschema` validates with, reads \\d \\w \\s as Unicode classes (١ is a digit,
\\x1c and \\x85 are spaces, U+FEFF is not); the backends read them their own way
(Rust regex in llguidance and outlines-core, xgrammar's converter), and for a
negated class each of those readings lets through something another refuses
(measured: \\D gave '١' on all three, \\S gave '\\x1c', xgrammar's \\s U+FEFF).

`portable_classes(pattern)` rewrites every \\d \\w \\s \\D \\W \\S and `.` as an
explicit class of the characters that *both* ECMA-262 and Python's `re` put in it,
so whatever a backend generates passes either check: \\d is [0-9], \\s the
whitespace both agree on, \\S and \\D and \\W exclude what either reading counts
as space, digit or word character, `.` excludes ECMA's line terminators. Inside a
bracket expression a class adds its characters the same way ([^\\s] then excludes
every space either reading knows). Python's sets are read from `re` itself, once.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable

_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
Ranges = tuple[tuple[int, int], ...]          # sorted, disjoint, inclusive

_ECMA = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF)),
}
# `.` in ECMA-262 excludes its line terminators; Python's excludes "\n" only.
_ECMA_LINE_TERMINATORS: Ranges = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))


@functools.lru_cache(maxsize=None)
def _python(letter: str) -> Ranges:
    """The code points Python's `re` puts in \\d, \\w or \\s (str patterns)."""
    text = "".join(map(chr, range(_SURROGATES[0]))) + \
        "".join(map(chr, range(_SURROGATES[1] + 1, _MAX + 1)))
    gap = _SURROGATES[1] - _SURROGATES[0] + 1

    def cp(i: int) -> int:
        return i if i < _SURROGATES[0] else i + gap
    return tuple((cp(m.start()), cp(m.end() - 1)) for m in re.finditer(f"\\{letter}+", text))


def _union(a: Ranges, b: Ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(a + b):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(a: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in _union(a, (_SURROGATES,)):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX:
        out.append((start, _MAX))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_union(_complement(a), _complement(b)))


@functools.lru_cache(maxsize=None)
def _members(letter: str, either: bool) -> Ranges:
    """The characters in \\<letter> (a negated class when upper case) under both
    readings (safe to generate for it), or under either one (`either`: what a
    check may accept for it)."""
    low = letter.lower()
    py, ecma = _python(low), _ECMA[low]
    wide = letter == low if either else letter != low
    joined = _union(py, ecma) if wide else _intersect(py, ecma)
    return joined if letter == low else _complement(joined)


def _char(cp: int) -> str:
    """One code point as every backend's class syntax reads it literally: ASCII
    letters and digits as they are, other ASCII as \\uHHHH (Rust regex would read a
    bare `-`, `&`, `~` or `[` as class syntax; xgrammar reads \\x5Fa as one hex
    number), the rest as the character."""
    if cp < 0x80:
        ch = chr(cp)
        return ch if ch.isalnum() else f"\\u{cp:04X}"
    return chr(cp)


def _items(ranges: Ranges) -> str:
    return "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)


@functools.lru_cache(maxsize=None)
def _outside(letter: str, either: bool) -> str:
    """A class standing alone: \\d -> [0-9]; a negated one as [^...] of what it
    excludes (shorter than listing what is left)."""
    if letter == ".":
        return "[^\\u000A]" if either else f"[^{_items(_ECMA_LINE_TERMINATORS)}]"
    if letter.islower():
        return f"[{_items(_members(letter, either))}]"
    return f"[^{_items(_members(letter.lower(), not either))}]"


@functools.lru_cache(maxsize=None)
def _inside(letter: str, negated: bool, either: bool) -> str:
    """The class's items inside a bracket expression; in [^...] they are excluded,
    so there the other reading's set is the one that keeps the class's meaning."""
    return _items(_members(letter, either != negated))


# The control characters JSON writes only as \u00XX (and \b, \f). llguidance 1.9.1
# quotes a string pattern's class holding some of them so that `\"` and `\\` pass
# even where the class excludes `"` or `\`: measured, `[^"]*` took `a\"b`, `[^\\]*`
# `a\\b`, `[^"\n]*` too (`[^"\t]*` did not). A JSON string's negated classes
# (`json_string`) leave them out, which they then never generate (\t \n \r stay);
# for llguidance (`rust_sets`) its positive classes lose them by a class intersection,
# `[[...]&&[^...]]` (Rust regex syntax, which it reads right: `^[\x00-\x1fa]*$` took
# `a\"a` and `a\\a` as written, neither once intersected).
_JSON_CONTROLS: Ranges = ((0x00, 0x08), (0x0B, 0x0C), (0x0E, 0x1F))


def _json_negated_end(json_string: bool) -> str:
    return _items(_JSON_CONTROLS) if json_string else ""


def _rewrite(pattern: str, outside: Callable[[str], str], inside: Callable[[str, bool], str],
             dot: str | None, bounds: dict[str, str], close: Callable[[bool], str],
             opening: Callable[[bool], str] = lambda negated: "[^" if negated else "[") -> str:
    """The one scan both rewrites share: each \\d \\w \\s \\D \\W \\S becomes
    outside(letter) or, in a bracket expression, inside(letter, negated); `.` becomes
    `dot` (None: kept); \\b \\B outside brackets become bounds[letter] where given;
    opening(negated) is written for a bracket expression's `[` (or `[^`) and
    close(negated) before its `]`. Inside brackets `[`, `&&`
    and `~~` are written as the literals ECMA-262 and Python read them as, a `-`
    after a spelled-out class as a literal, and a `]` first in the class as one."""
    out, i, cls_negated = [], 0, None          # None: outside a bracket expression
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            esc = pattern[i + 1]
            if esc in "dwsDWS":
                out.append(outside(esc) if cls_negated is None else inside(esc, cls_negated))
                i += 2
                if cls_negated is not None and pattern[i:i + 1] == "-" \
                        and pattern[i + 1:i + 2] != "]":
                    out.append("\\u002D")         # [\w-a]: a literal -, not a range now
                    i += 1
            else:
                out.append(bounds.get(esc, pattern[i:i + 2]) if cls_negated is None
                           else pattern[i:i + 2])
                i += 2
            continue
        if cls_negated is None:
            if ch == "[":
                i += 1
                cls_negated = pattern[i:i + 1] == "^"
                out.append(opening(cls_negated))
                i += cls_negated
                if pattern[i:i + 1] == "]":        # a literal ] first in the class
                    out.append("\\u005D")
                    i += 1
                continue
            out.append(dot if ch == "." and dot is not None else ch)
        else:
            if ch == "]":
                out.append(close(cls_negated))
                cls_negated = None
            elif ch == "[" or pattern[i:i + 2] in ("&&", "~~"):
                # literal here for ECMA-262 and Python; Rust regex (llguidance,
                # outlines-core) reads a nested class, [:alpha:] or a set operation,
                # and the regex package ([[:alpha:]]) a POSIX class
                out.append(f"\\u{ord(ch):04X}")
                i += 1
                continue
            out.append(ch)
        i += 1
    return "".join(out)


def portable_classes(pattern: str, either: bool = False, json_string: bool = False,
                     rust_sets: bool = False) -> str:
    """`pattern` with \\d \\w \\s \\D \\W \\S and `.` spelled out (module doc): as
    what both readings match, or (`either`) what either may match: the language a
    check may accept, for proofs that must not assume the narrower one. Inside a
    bracket expression `[`, `&&` and `~~` are written as the literals ECMA-262
    and Python read them as (`[[:alpha:]]` is the set `[:alph` then `]` there,
    and a POSIX class to Rust regex). Other escapes and syntax are left as they are."""
    json_end = _json_negated_end(json_string)

    def outside(letter: str) -> str:
        spelled = _outside(letter, either)
        return spelled[:-1] + json_end + "]" if spelled.startswith("[^") else spelled

    def close(negated: bool) -> str:
        # llguidance's negated class admits U+D7FF and U+E000 whenever it holds both
        # (`[^\\W_]`: both are \\W): the two sides of the surrogate gap merge and its
        # complement is cut one off at each end. The same class with the gap as one
        # explicit range is right, and adds nothing where a class lacked either (they
        # are then excluded: an unassigned and a private-use character).
        if not negated:
            return f"]&&[^{json_end}]" if intersect else ""
        return ("" if either else f"{_char(0xD7FF)}-{_char(0xE000)}") + json_end

    # a positive class intersected is nested whole, `[[...]&&[^...]]`, so that a `-`
    # it ends with stays a literal
    intersect = bool(json_end) and rust_sets
    return _rewrite(pattern, outside, lambda letter, negated: _inside(letter, negated, either),
                    dot=outside("."), bounds={}, close=close,
                    opening=lambda negated: "[^" if negated else ("[[" if intersect else "["))


@functools.lru_cache(maxsize=None)
def _re_items(letter: str) -> str:
    """The items of \\<letter> exactly as Python's `re` reads it (upper case: negated)."""
    members = _python(letter.lower())
    return _items(members if letter.islower() else _complement(members))


def re_classes(pattern: str) -> str | None:
    """`pattern` (valid for Python's `re`) with \\d \\w \\s \\D \\W \\S spelled out as
    the explicit sets `re` reads them as, and \\b \\B as lookarounds over \\w's set:
    the same language under the `regex` package, whose own classes differ from
    `re`'s (\\w: 30,468 code points, \\d: 110, \\s: 4 -- combining marks are word
    characters there). None for a pattern with an ASCII or locale flag, where `re`'s
    classes are not these sets."""
    if re.search(r"\(\?[a-zA-Z]*[aL]", pattern):
        return None
    word = f"[{_re_items('w')}]"
    bounds = {"b": f"(?:(?<={word})(?!{word})|(?<!{word})(?={word}))",
              "B": f"(?:(?<={word})(?={word})|(?<!{word})(?!{word}))"}
    return _rewrite(pattern,
                    lambda letter: (f"[{_re_items(letter)}]" if letter.islower()
                                    else f"[^{_re_items(letter.lower())}]"),
                    lambda letter, negated: _re_items(letter),
                    dot=None, bounds=bounds, close=lambda negated: "")
