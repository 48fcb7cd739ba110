"""XGRAMMAR_FORMAT_LENGTHS (grammar/schema_rules.py) recomputed from the EBNF
xgrammar builds for each format: a minLength up to the shortest string (or a
maxLength from the longest) is implied by the format and needs no enforcing.
"""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from formwork.grammar.schema_check import find_issues
from formwork.grammar.schema_rules import XGRAMMAR_FORMAT_LENGTHS
from formwork.grammar.xgrammar_backend import to_xgrammar
from formwork.schemas.structured import StructuredOutputsParams

_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])'
                    r'|(?P<rep>\{\s*\d+\s*,\s*-?\d+\s*\})|(?P<id>[A-Za-z_][A-Za-z0-9_]*)'
                    r'|(?P<op>\(=|[()|*+?]))')


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        assert m, text[pos:]
        out.append(next((k, v) for k, v in m.groupdict().items() if v is not None))
        pos = m.end()
    return out


def _literal_length(lit: str) -> int:
    """Code points a literal adds to the decoded JSON string: a backslash starts
    an escape whose next literal character is the decoded one (no \\u here)."""
    body = re.sub(r"\\(.)", r"\1", lit[1:-1])
    return len(body.replace("\\", ""))


def _lengths(grammar: str, rule: str = "root") -> tuple[int, float]:
    """(shortest, longest) expansion of `rule`, in decoded code points."""
    rules = {}
    for line in grammar.splitlines():
        name, _, body = line.partition(" ::= ")
        rules[name] = _tokens(body)

    def span(toks, i, env, pick):          # -> (value, next index) of an alternation
        best, i = None, i
        while True:
            total = 0
            while i < len(toks) and toks[i] not in (("op", "|"), ("op", ")")):
                kind, text = toks[i]
                if (kind, text) in (("op", "("), ("op", "(=")):
                    value, i = span(toks, i + 1, env, pick)
                    value = 0 if text == "(=" else value
                    i += 1
                elif kind == "str":
                    value, i = _literal_length(text), i + 1
                elif kind == "cls":
                    value, i = 1, i + 1
                else:
                    value, i = env[text], i + 1
                if i < len(toks) and toks[i][0] in ("rep", "op") and \
                        toks[i][1] in ("*", "+", "?") or i < len(toks) and toks[i][0] == "rep":
                    q = toks[i][1]
                    lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}.get(q) or \
                        tuple(int(x) for x in q.strip("{}").split(","))
                    n = lo if pick is min else math.inf if hi < 0 else hi
                    value = 0 if n == 0 or value == 0 else value * n
                    i += 1
                total += value
            best = total if best is None else pick(best, total)
            if i >= len(toks) or toks[i] == ("op", ")"):
                return best, i
            i += 1

    out = []
    for pick, start in ((min, math.inf), (max, 0)):
        env = dict.fromkeys(rules, start)
        for _ in range(200):
            new = {name: span(toks, 0, env, pick)[0] for name, toks in rules.items()}
            changed = {n for n in new if new[n] != env[n]}
            env = new
            if not changed:
                break
            if _ > 100:                    # still growing: unbounded through recursion
                env |= dict.fromkeys(changed, math.inf)
        out.append(env[rule])
    return out[0], out[1]


@pytest.mark.parametrize("fmt", sorted(XGRAMMAR_FORMAT_LENGTHS))
def test_format_lengths_match_xgrammar_grammars(fmt):
    text = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": fmt})))
    shortest, longest = _lengths(text)
    expected = XGRAMMAR_FORMAT_LENGTHS[fmt]
    assert (shortest - 2, longest - 2) == (expected[0], expected[1] or math.inf)   # - quotes


@pytest.mark.parametrize("schema,flagged", [
    ({"type": "string", "format": "uuid", "minLength": 1}, False),
    ({"type": "string", "format": "date-time", "minLength": 1}, True),    # a loose format
    ({"type": "string", "format": "ipv4", "minLength": 7}, True),          # a loose format
    ({"type": "string", "format": "email", "minLength": 3}, False),
    ({"type": "string", "format": "email", "maxLength": 1024}, True),
    ({"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36}, False),
    ({"type": "string", "format": "uuid", "maxLength": 35}, True),
    ({"type": "string", "format": "hostname", "minLength": 1}, True),     # not in the table
    ({"type": "string", "format": "date", "pattern": "^2", "minLength": 1}, True),
])
def test_lengths_implied_by_a_format(schema, flagged):
    assert bool(find_issues(schema, "xgrammar")) == flagged


def test_implied_lengths_hold_for_what_the_grammar_accepts():
    schema = {"type": "object", "properties": {
        "at": {"type": "string", "format": "uuid", "minLength": 1},
        "mail": {"type": "string", "format": "email", "minLength": 2}}}
    grammar = to_xgrammar(StructuredOutputsParams(json=schema, whitespace="compact"))
    for instance, ok in [({"at": "123e4567-e89b-12d3-a456-426614174000", "mail": "a@b"}, True),
                         ({"mail": "a"}, False), ({"at": ""}, False)]:
        assert jsonschema.Draft202012Validator(schema).is_valid(instance) or not ok
        text = json.dumps(instance, separators=(",", ":"))
        assert _is_grammar_accept_string(grammar, text) == ok, text
