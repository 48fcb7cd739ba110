"""Rules of an xgrammar grammar that derive no finite text.

`root ::= "a" root` is valid EBNF whose language is empty; so is a JSON Schema
whose required property refers back to the schema (`{"properties": {"a": {"$ref":
"#"}}, "required": ["a"]}`), and `root ::= "b" | "a" x` with `x ::= "a" x` has
an alternative that can never end. xgrammar's mask lets the output into such a
rule, and its `find_jump_forward_string` then never returns (the forced text is
"aaaa..." without end): the engine thread hung until the process was killed, and
every restart's replay hung again. vLLM (no jump-forward) would write "a" to
max_tokens, invalid all the same.

`unproductive_rules(grammar)` reads xgrammar's normalized grammar text
(`str(xgr.Grammar)`: one `name ::= body` per line, bodies of literals, character
classes, rule references with quantifiers, groups, lookaheads, `Regex(...)`) and
returns the rules no finite text derives from, by the usual fixed point. It
returns None for text it cannot read (a construct not listed here): the caller
then turns jump-forward off for that grammar, which is what can hang.

No library offers this for xgrammar's grammars (its C++ has no productivity
check and llguidance's only applies to its own Lark), hence the small reader.
"""
from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_QUANT = re.compile(r"\{\s*(-?\d+)\s*,\s*(-?\d+)\s*\}|\{\s*(\d+)\s*\}|[*+?]")


class _Unreadable(Exception):
    pass


# An expression: ("lit",) always derives text; ("ref", name); ("seq", [items]);
# ("alt", [items]); an item with a zero minimum count always derives text.
_LIT = ("lit",)


class _Reader:
    def __init__(self, text: str):
        self.s, self.i = text, 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def peek(self, k: int = 1) -> str:
        return self.s[self.i:self.i + k]

    def quoted(self, close: str) -> None:
        """Skip a literal or class up to its unescaped `close`."""
        self.i += 1
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch == "\\":
                self.i += 2
                continue
            self.i += 1
            if ch == close:
                return
        raise _Unreadable("unterminated literal")

    def alternatives(self) -> tuple:
        alts = [self.sequence()]
        self.ws()
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
            self.ws()
        return ("alt", alts)

    def sequence(self) -> tuple:
        items = []
        while True:
            self.ws()
            ch = self.peek()
            if not ch or ch in "|)":
                return ("seq", items)
            items.append(self.item())

    def item(self) -> tuple:
        atom = self.atom()
        m = _QUANT.match(self.s, self.i)
        if not m:
            return atom
        self.i = m.end()
        text = m.group(0)
        least = 0 if text in ("*", "?") else 1 if text == "+" else \
            int(m.group(1) if m.group(1) is not None else m.group(3))
        return _LIT if least <= 0 else atom

    def atom(self) -> tuple:
        ch = self.peek()
        if ch == '"':
            self.quoted('"')
            return _LIT
        if ch == "[":
            self.quoted("]")
            return _LIT
        if self.peek(2) == "(=":               # a lookahead: consumes nothing
            self.i += 2
            self.alternatives()
            self._close()
            return _LIT
        if ch == "(":
            self.i += 1
            inner = self.alternatives()
            self._close()
            return inner
        if self.s.startswith("Regex(", self.i):
            self.i += len("Regex")
            self._skip_call()
            return _LIT
        m = _NAME.match(self.s, self.i)
        if not m:
            raise _Unreadable(f"unexpected {ch!r}")
        self.i = m.end()
        if self.peek() == "(":
            if m.group(0) != "TagDispatch":
                raise _Unreadable(f"built-in {m.group(0)}")
            # free text until a trigger, each dispatched to its own rule (listed
            # and judged on its own line): it may end with no trigger written
            self._skip_call()
            return _LIT
        return ("ref", m.group(0))

    def _close(self) -> None:
        self.ws()
        if self.peek() != ")":
            raise _Unreadable("unbalanced group")
        self.i += 1

    def _skip_call(self) -> None:
        depth = 0
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch == '"':
                self.quoted('"')
                continue
            self.i += 1
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    return
        raise _Unreadable("unbalanced call")


def _rules(text: str) -> dict[str, tuple]:
    lines: list[str] = []
    for line in text.splitlines():
        if " ::= " in line and _NAME.fullmatch(line.partition(" ::= ")[0].strip()):
            lines.append(line)
        elif line.strip():
            if not lines:
                raise _Unreadable(f"not a rule: {line[:40]!r}")
            lines[-1] += " " + line.strip()     # TagDispatch( spans lines
    rules: dict[str, tuple] = {}
    for line in lines:
        name, sep, body = line.partition(" ::= ")
        if not sep or not _NAME.fullmatch(name.strip()):
            raise _Unreadable(f"not a rule: {line[:40]!r}")
        reader = _Reader(body)
        expr = reader.alternatives()
        reader.ws()
        if reader.i != len(body):
            raise _Unreadable(f"trailing text in rule {name}")
        rules[name.strip()] = expr
    return rules


def _derives(expr: tuple, productive: set[str]) -> bool:
    kind = expr[0]
    if kind == "lit":
        return True
    if kind == "ref":
        return expr[1] in productive
    if kind == "seq":
        return all(_derives(e, productive) for e in expr[1])
    return any(_derives(e, productive) for e in expr[1])


def unproductive_rules(grammar_text: str) -> list[str] | None:
    """Names of the rules that derive no finite text ([] if none), in the grammar's
    order; None where the text holds a construct this reader does not know."""
    try:
        rules = _rules(grammar_text)
    except _Unreadable:
        return None
    refs = set()
    for expr in rules.values():
        stack = [expr]
        while stack:
            e = stack.pop()
            if e[0] == "ref":
                refs.add(e[1])
            elif e[0] in ("seq", "alt"):
                stack.extend(e[1])
    if not refs <= rules.keys():
        return None                              # a rule it refers to is not listed
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in productive and _derives(expr, productive):
                productive.add(name)
                changed = True
    return [name for name in rules if name not in productive]


class NoFiniteOutput(Exception):
    """Marks a refusal that holds for every backend: no output can ever end. `auto`
    does not try another backend (llguidance's mask also lets the output into the
    rule; it does not hang, it writes to max_tokens)."""


class InfiniteGrammarError(ValueError, NoFiniteOutput):
    pass


def recursive_refs(schema) -> bool:
    """Whether a `$ref` of `schema` leads back into its own target (`"$ref": "#"`
    inside the root, `#/$defs/node` inside node): only such schemas can hold a
    rule without finite text. A cheap gate, so that xgrammar (and torch) load for
    the productivity check only where it can find something."""
    refs: list[tuple[str, str]] = []          # (where the $ref sits, its target), as pointers

    def walk(node, at: str) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                refs.append((at, ref[1:]))
            for k, v in node.items():
                walk(v, f"{at}/{str(k).replace('~', '~0').replace('/', '~1')}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{at}/{i}")

    walk(schema, "")

    def inside(at: str, target: str) -> bool:
        return at == target or at.startswith(target + "/") or target == ""

    edges = {t: {t2 for at, t2 in refs if inside(at, t)} for _, t in refs}
    for start in edges:                       # a target reaching itself
        stack, seen = list(edges[start]), set()
        while stack:
            t = stack.pop()
            if t == start:
                return True
            if t not in seen:
                seen.add(t)
                stack.extend(edges.get(t, ()))
    return False
