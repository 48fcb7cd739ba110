"""regex_classes.portable_classes against two independent references: Python's `re`
on the original pattern, and ECMA-262's classes built here from `unicodedata`."""
from __future__ import annotations

import re
import unicodedata

import pytest

from formwork.grammar.regex_classes import portable_classes

# Every ASCII and Latin-1 character, the BMP in steps, and the characters where the
# readings differ (Unicode digits, spaces, U+FEFF, astral digits and letters).
SAMPLE = sorted({chr(c) for c in range(0x300)} | {chr(c) for c in range(0x300, 0x10000, 7)
                                                    if not 0xD800 <= c <= 0xDFFF}
                | set("\u0661\u0966\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000"
                      "\ufeff\uff10\u180e\u200b") | {"\U0001D7CE", "\U0001D400", "\U0010FFFF"})


def _ecma_in(letter: str, ch: str) -> bool:
    """ECMA-262 (no `u` flag): \\d [0-9], \\w [A-Za-z0-9_], \\s WhiteSpace (TAB VT FF
    SP NBSP ZWNBSP and category Zs) and LineTerminator (LF CR LS PS)."""
    low = letter.lower()
    if low == "d":
        inside = "0" <= ch <= "9"
    elif low == "w":
        inside = ch.isascii() and (ch.isalnum() or ch == "_")
    else:
        inside = ch in "\t\v\f \u00a0\ufeff\n\r\u2028\u2029" or unicodedata.category(ch) == "Zs"
    return inside if letter == low else not inside


def _ecma_matches(form: str, ch: str) -> bool:
    """The one-character forms below, under ECMA-262's reading."""
    if form == ".":
        return ch not in "\n\r\u2028\u2029"
    if not form.startswith("["):
        return _ecma_in(form[1], ch)
    negated = form.startswith("[^")
    hit = _ecma_in(form[-2], ch)
    return hit != negated


FORMS = ["\\d", "\\D", "\\w", "\\W", "\\s", "\\S", ".", "[\\d]", "[^\\d]", "[\\D]", "[^\\D]",
         "[\\w]", "[^\\w]", "[\\W]", "[^\\W]", "[\\s]", "[^\\s]", "[\\S]", "[^\\S]"]


@pytest.mark.parametrize("form", FORMS)
def test_both_reading_is_inside_python_and_ecma_and_either_covers_them(form):
    both = re.compile(portable_classes(form))
    either = re.compile(portable_classes(form, either=True))
    python = re.compile(form)
    for ch in SAMPLE:
        py, ecma = bool(python.fullmatch(ch)), _ecma_matches(form, ch)
        if both.fullmatch(ch):
            assert py and ecma, (form, hex(ord(ch)))
        else:
            assert not (py and ecma), (form, hex(ord(ch)))     # nothing both accept is lost
        assert bool(either.fullmatch(ch)) == (py or ecma), (form, hex(ord(ch)))


def test_the_rest_of_a_pattern_is_kept():
    assert portable_classes("^\\d{3}-\\w+$") == "^[0-9]{3}-[0-9A-Z\\u005Fa-z]+$"
    assert portable_classes("\\.\\\\d[.]") == "\\.\\\\d[.]"        # escaped, and `.` in a class
    pattern = portable_classes("[\\w-a]+")                         # a literal -, not a range
    assert re.fullmatch(pattern, "-") and re.fullmatch(pattern, "a_") and not re.fullmatch(pattern, "!")
    assert re.fullmatch(portable_classes("[]x]"), "]")
    assert portable_classes("\\p{L}+\\b") == "\\p{L}+\\b"


@pytest.mark.parametrize("pattern,texts", [
    ("^[[:alpha:]]+$", {":]": True, "a]": True, "[]]": True, "Wow": False, "ab": False}),
    ("^[a&&b]$", {"a": True, "&": True, "b": True, "": False}),
    ("^[x~~]$", {"x": True, "~": True, "y": False}),
])
def test_bracket_syntax_rust_reads_otherwise_is_literal(pattern, texts):
    """`[` inside a class and `&&` / `~~` are literals to ECMA-262 and Python; Rust
    regex (llguidance, outlines-core) read `[[:alpha:]]` as letters (walks wrote
    "Wow", which Python's re refuses) and `[a&&b]` as an empty intersection. The
    rewrite keeps Python's meaning, and the rewritten pattern says the same in Rust's
    syntax (no bare `[`, `&&`, `~~` left inside a class)."""
    import warnings
    rewritten = portable_classes(pattern)
    assert "[[" not in rewritten and "&&" not in rewritten and "~~" not in rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # Python: "possible nested set"
        for text, expected in texts.items():
            assert bool(re.fullmatch(pattern, text)) == expected, text
            assert bool(re.fullmatch(rewritten, text)) == expected, text


@pytest.mark.parametrize("pattern", [
    r"\w", r"\W", r"\d+", r"\D", r"\s", r"\S", r"[\w-]+", r"[^\W_]", r"[\d\s]", r"a\b",
    r"\bfoo\b", r"\Bx", r"[[:alpha:]]", r"[]a]", r"[^]a]", r"(?i)\w+", r"x{2}\w?"])
def test_re_classes_read_as_re_reads_them_under_the_regex_package(pattern):
    """gateway/output_check.py matches client patterns with the `regex` package (it
    takes a timeout); its own \\w \\d \\s differ from `re`'s, the spelled-out ones
    do not: random strings of characters from every plane, search and fullmatch."""
    import random
    import warnings

    import regex

    from formwork.grammar.regex_classes import re_classes

    rng = random.Random(pattern)
    chars = [chr(c) for c in (rng.randrange(0x20, 0x30000) for _ in range(2000))
             if not 0xD800 <= c <= 0xDFFF] + list("\u0e38\u00b2\u0663\u2177_ a-\x1c\x85[:alph]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)        # both: "possible nested set"
        ours = regex.compile(re_classes(pattern), flags=regex.VERSION0)
        theirs = re.compile(pattern)
    for _ in range(2000):
        s = "".join(rng.choice(chars) for _ in range(rng.randint(0, 4)))
        for f in ("search", "fullmatch"):
            assert bool(getattr(ours, f)(s)) == bool(getattr(theirs, f)(s)), (f, s)
    assert re_classes(r"(?a)\w") is None
