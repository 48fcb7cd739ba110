"""Anchored patterns proven disjoint by their fixed leading characters
(grammar/pattern_prefix.py): a table of what is and is not provable, and a
property check that a proof is never wrong (strings drawn from one pattern never
match the other)."""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formwork.grammar.pattern_prefix import literal_prefix, patterns_disjoint


@pytest.mark.parametrize("pattern, prefix", [
    ("^abc", ["a", "b", "c"]),
    ("^ab+", ["a"]),                      # a quantified atom ends the prefix
    ("^a.c", ["a", None, "c"]),
    ("^\\d-x", [None, "-", "x"]),
    ("^\\.\\n", [".", "\n"]),
    ("^a[bc]", ["a"]),
    ("^x{2}", []),
    ("^(a)", []),
    ("abc", None),                         # not anchored
    ("^a|^b", None),                       # top-level alternation
    ("^(a|b)c", []),                       # alternation inside a group is fine
    ("^[|]a", []),                         # `|` inside a class is no alternation
    ("^\\|a", ["|", "a"]),
    ("^\\bx", []),                       # an alphanumeric escape is not a literal
    (3, None),
])
def test_literal_prefix_table(pattern, prefix):
    assert literal_prefix(pattern) == prefix


@pytest.mark.parametrize("a, b, disjoint", [
    ("^id-", "^no-", True),
    ("^a\\d", "^b\\d", True),
    ("^ab", "^a", False),                 # one a prefix of the other
    ("^a.c", "^abd", True),
    ("^a.c", "^abc", False),
    ("^x", "x", False),                   # b unanchored: unprovable
    ("^(a|b)", "^c", False),              # prefix empty: unprovable
])
def test_patterns_disjoint_table(a, b, disjoint):
    assert patterns_disjoint(a, b) is disjoint
    assert patterns_disjoint(b, a) is disjoint


PATTERNS = ["^a", "^ab", "^a.c", "^\\d+", "^1\\.", "^x-[a-z]+$", "^[ab]c", "^\\.\\d", "^b|c",
            "^(a|b)x", "^a\\|", "^ba"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(PATTERNS), st.sampled_from(PATTERNS))
def test_a_disjointness_proof_is_never_wrong(data, a, b):
    if not patterns_disjoint(a, b):
        return
    s = data.draw(st.from_regex(a))
    assert re.search(b, s) is None, (a, b, s)
