"""GBNF (xgrammar's EBNF, llama.cpp's grammar format) as Lark for llguidance.

llguidance ships the converter (`llguidance.gbnf_to_lark`, the one vLLM's `guidance`
backend uses); formwork keeps its parser and printer and mends three things in it
that refused grammars xgrammar serves (found by random grammars through the server,
llguidance 1.9.1):

- a repetition of a repetition lost its parentheses: `(x+)+` was printed `x++`,
  `("a"{2}){1}` `"a"{2,2}{1,1}`, which Lark cannot read ("Expected value");
- `\\u00e9` was printed `\\ue9` (leading zeros stripped), `\\U0001F600` `\\U1F600`,
  which llguidance's lexer and regex parser refuse; such escapes are handed to the
  converter as the character itself (or `\\xHH` below 0x100, where the character may
  be one GBNF gives a meaning);
- `\\-` and `\\^` (xgrammar reads them inside a character class, llama.cpp does not)
  were an "Invalid escape sequence"; they are handed over as `\\x2d` and `\\x5e`.

`repeats_what_can_be_empty(text)` finds the grammars whose parse xgrammar's parser
slows on: a repetition of something that can match the empty string (`(w | s)*`
with `s ::= [ ]*`, `(([a-z]*)*)*`) splits the same text in ever more ways. Measured
on SmolLM2's vocabulary, per token's mask: `(w | s)* "."` 212, 327, 944 ms then the
fill limit, `([a-z]+ | " "*)*` 32 ms every token; llguidance 0-3 ms on both.

A rule still converts to a Lark terminal where all its parts are terminals, as
upstream does; that changes which texts llguidance's lexer lets through, never
what it lets out (every text it accepts is in the grammar's language).
"""
from __future__ import annotations

import functools
import re

from llguidance import gbnf_to_lark as _upstream

# an escape and what follows it, left to right, so that `\\u0041` stays a backslash
# then "u0041"
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([\s\S]))")


def is_gbnf(text: str) -> bool:
    """Whether a grammar is GBNF (xgrammar's dialect); the others are taken as Lark."""
    return "::=" in text


def _plain_escapes(text: str) -> str:
    def one(m: re.Match) -> str:
        hex_digits = m.group(1) or m.group(2)
        if hex_digits is None:
            other = m.group(3)
            return {"-": "\\x2d", "^": "\\x5e"}.get(other, m.group(0))
        code = int(hex_digits, 16)
        if code < 0x100:
            return f"\\x{code:02x}"
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            return m.group(0)          # no character: the converter's own error stands
        return chr(code)
    return _ESCAPE.sub(one, text)


def _group_nested_repetitions(node: _upstream.ASTNode) -> None:
    for child in node.children():
        _group_nested_repetitions(child)
    if isinstance(node, _upstream.RepetitionNode) and \
            isinstance(node.node, _upstream.RepetitionNode):
        # a one-item sequence prints as its item, and a repetition parenthesizes
        # a sequence: `(x+)+`
        node.node = _upstream.SequenceNode([node.node])


def gbnf_to_lark(text: str) -> str:
    """The Lark grammar (llguidance's dialect) for a GBNF grammar. Raises what
    llguidance's converter raises (bare Exceptions among them) for one it cannot read."""
    rules = _upstream.GrammarParser().parse(_plain_escapes(text))
    _upstream.resolve(rules)
    for rule in rules.values():
        _group_nested_repetitions(rule)
    # printed as llguidance.gbnf_to_lark.gbnf_to_lark prints them
    out = "%llguidance {}\n\n"
    prev_nl = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        s = str(rule)
        if not prev_nl and "\n" in s:
            out += "\n"
        out += s + "\n"
        prev_nl = "\n" in s
        if prev_nl:
            out += "\n"
    return out


def _nullable(node: _upstream.ASTNode, rules: dict[str, bool]) -> bool:
    """Whether `node` matches the empty string (`rules`: what is known of each rule)."""
    if isinstance(node, _upstream.LiteralNode):
        return node.value == ""
    if isinstance(node, _upstream.RegexNode):
        return False
    if isinstance(node, _upstream.RuleRefNode):
        return rules.get(node.name, False)
    if isinstance(node, _upstream.RepetitionNode):
        return node.min_times == 0 or _nullable(node.node, rules)
    if isinstance(node, _upstream.SequenceNode):
        return all(_nullable(n, rules) for n in node.nodes)
    if isinstance(node, _upstream.AlternativeNode):
        return any(_nullable(n, rules) for n in node.alternatives)
    return False


@functools.lru_cache(maxsize=256)
def repeats_what_can_be_empty(text: str) -> bool:
    """Whether a GBNF grammar repeats (more than once) a part that can match the
    empty string. False where llguidance's parser cannot read the grammar."""
    try:
        parsed = _upstream.GrammarParser().parse(_plain_escapes(text))
    except Exception:         # the parser raises bare Exceptions
        return False
    nullable = {name: False for name in parsed}
    changed = True
    while changed:            # to a fixed point: rules refer to each other
        changed = False
        for name, rule in parsed.items():
            if not nullable[name] and _nullable(rule.alternatives, nullable):
                nullable[name] = changed = True

    def walk(node: _upstream.ASTNode) -> bool:
        if isinstance(node, _upstream.RepetitionNode) and \
                (node.max_times is None or node.max_times > 1) and _nullable(node.node, nullable):
            return True
        return any(walk(child) for child in node.children())
    return any(walk(rule.alternatives) for rule in parsed.values())
