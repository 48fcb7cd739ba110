"""Can a JSON Schema `pattern` only match characters that are literal in JSON?

outlines-core splices a string's `pattern` between the quotes of the JSON
string, so a pattern that can match `"`, `\\` or a control character would
let the model produce text that is not JSON. Conservative: anything we cannot
prove safe (negated classes, `.`, `\\s`, `\\W`, syntax Python's parser does
not know) is unsafe.
"""
from __future__ import annotations

import re
import re._constants as c
import re._parser as sre_parse
import warnings

_UNSAFE_CATEGORIES = {c.CATEGORY_SPACE, c.CATEGORY_NOT_SPACE, c.CATEGORY_NOT_WORD,
                      c.CATEGORY_NOT_DIGIT, c.CATEGORY_LINEBREAK, c.CATEGORY_NOT_LINEBREAK}
_SAFE_ATS = {c.AT_BEGINNING, c.AT_END, c.AT_BEGINNING_STRING, c.AT_END_STRING}


def _char_ok(code: int) -> bool:
    return code >= 0x20 and code not in (0x22, 0x5C)


def _class_ok(items) -> bool:
    for op, av in items:
        if op is c.NEGATE:
            return False
        if op is c.LITERAL and not _char_ok(av):
            return False
        if op is c.RANGE and (av[0] < 0x20 or av[0] <= 0x22 <= av[1] or av[0] <= 0x5C <= av[1]):
            return False
        if op is c.CATEGORY and av in _UNSAFE_CATEGORIES:
            return False
    return True


def _seq_ok(seq) -> bool:
    for op, av in seq:
        if op is c.LITERAL:
            ok = _char_ok(av)
        elif op is c.IN:
            ok = _class_ok(av)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            ok = _seq_ok(av[2])
        elif op is c.SUBPATTERN:
            ok = av[1] == 0 and av[2] == 0 and _seq_ok(av[3])   # no inline flags
        elif op is c.BRANCH:
            ok = all(_seq_ok(branch) for branch in av[1])
        elif op is c.AT:
            ok = av in _SAFE_ATS
        else:   # ANY, NOT_LITERAL, lookarounds, group references, ...
            ok = False
        if not ok:
            return False
    return True


def pattern_is_json_safe(pattern: str) -> bool:
    """True if every string `pattern` can match is free of `"`, `\\` and C0 controls."""
    try:
        with warnings.catch_warnings():   # "Possible nested set" on a user's `[[`: a warning
            warnings.simplefilter("ignore", FutureWarning)    # about Python's future syntax
            parsed = sre_parse.parse(pattern)
    except (re.error, ValueError, RecursionError, OverflowError):
        return False
    return _seq_ok(parsed)


def has_top_level_alternation(pattern: str) -> bool:
    """True if `pattern` has a `|` outside any group and bracket expression
    (`^all|tags$`): outlines-core writes a pattern between a string's quotes
    without parentheses, so the quotes would belong to the first and last branch.
    (A textual scan: Python's parser folds `a|b` into a class.)"""
    depth, i, in_class = 0, 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            i += 1 + (pattern[i + 1:i + 2] == "^")
            i += pattern[i:i + 1] == "]"           # a literal ] first in the class
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            return True
        i += 1
    return False


def escape_literal(text: str) -> str:
    """Regex matching exactly `text` (Rust regex syntax, as outlines-core and
    llguidance parse it: punctuation and ASCII controls hex-escaped)."""
    return "".join(ch if ch.isalnum() or ord(ch) > 127 else f"\\x{{{ord(ch):X}}}" for ch in text)
