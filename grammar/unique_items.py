"""`uniqueItems` enforced while decoding: the plan (which sites) and the scanner.

No grammar says "no two items equal" (the language is not context-free), so the
backends refuse the keyword, and so did formwork: a pydantic `set[str]`,
`frozenset[int]` or `set[Enum]` field was a 400. The grammar now enforces
everything but `uniqueItems` at the served sites, and a matcher wrapper
(grammar/unique_items_matcher.py) follows the generated JSON and refuses, in the
mask and in `accept_tokens`, every token that would complete an item equal to an
earlier one of its array (equal as JSON values, as `jsonschema` compares them:
decoded strings, numbers by value, so `1.0` repeats `1`).

A site is served only where refusing duplicates can never leave the model with
no token (`_item_kind`, `_stuck`): string items without pattern/format/enum (one
below its maxLength can always take another character; one at it can only close,
so reaching it equal to a taken item is refused), integers whose digits can
always grow, enums of plain strings and integers (an item's bytes so far must
still begin an untaken value; no ',' once all are taken). And only where a
document position tells the schema node: reached from the root through
`properties`, `additionalProperties` (a schema, no `patternProperties` beside it),
`items` (one schema), local `$ref`s, `anyOf`/`oneOf` of differently typed
branches, and `anyOf`/`oneOf` of objects told apart by a first, required,
constant member (`_discriminated`). Any other `uniqueItems` stays in the schema,
and the backend refuses it, naming it.

This module imports neither torch nor a backend: the gateway runs it in its
schema checks. The scanner reads the bytes of each token (the grammar guarantees
the text is JSON, so it only tracks where it is: containers, the current key,
the current string or number); the matcher keeps its state after each accepted
token for rollback.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from formwork.grammar.schema_merge import ANNOTATIONS
from formwork.grammar.schema_rules import ASSERTIONS
from formwork.grammar.schema_walk import resolve_local_ref

_STRING_KEYS = frozenset({"type", "minLength", "maxLength"})
_ENUM_KEYS = frozenset({"type", "enum"})
_INTEGER_KEYS = frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_ARRAY_KEYS = frozenset({"type", "items", "uniqueItems", "minItems", "maxItems"})
_SCALARS = frozenset({"null", "boolean", "integer", "number", "string"})
# Keys whose subschemas a document position reaches unambiguously (see `_children`).
_STRUCTURAL = frozenset({"properties", "additionalProperties", "items"})
_DELIMITERS = frozenset(b",]} \t\n\r")


def _deref(root: Any, node: Any) -> Any:
    for _ in range(16):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
            return node
        target = resolve_local_ref(root, node["$ref"])
        if target is None:
            return None
        node = target[0]
    return None


def _relevant(node: dict) -> set[str]:
    """The keys that can fail an instance (formats are asserted by formwork)."""
    return {k for k in node if k in ASSERTIONS or k == "format"}


def _is_type(node: dict, name: str, default: bool) -> bool:
    t = node.get("type")
    if t is None:
        return default
    return t == name or (isinstance(t, list) and name in t and set(t) - {name} <= _SCALARS)


def _item_kind(root: Any, array: dict) -> tuple[str, tuple, int | None] | None:
    """('s', (), maxLength or None) string items without pattern/format/enum,
    ('i', (), None) integers whose digits can always grow, ('e', values, None) enum
    items (strings, integers) that can always be told apart and cannot run out
    before minItems; else None."""
    if _relevant(array) - _ARRAY_KEYS or not _is_type(array, "array", True):
        return None
    items = _deref(root, array.get("items"))
    if not isinstance(items, dict):
        return None
    keys = _relevant(items)
    if items.get("type") == "string" and keys <= _STRING_KEYS:
        # A string at its maxLength can only close (_stuck refuses reaching it equal to
        # a taken item); below it, any other character keeps it new. maxLength 0
        # allows one item only.
        most = items.get("maxLength")
        if most is None or (isinstance(most, int) and not isinstance(most, bool) and most >= 1):
            return "s", (), most
        return None
    if isinstance(items.get("enum"), list) and keys <= _ENUM_KEYS \
            and items.get("type") in (None, "string", "integer"):
        values = items["enum"]
        # Strings of printable ASCII without '"' or '\\' and integers: every backend
        # writes them as they are, so an item's bytes so far say which values it can
        # still become.
        if all(_plain(v) or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
            distinct = tuple(dict.fromkeys(values))
            least = array.get("minItems", 0)
            if isinstance(least, int) and least <= len(distinct):
                return "e", distinct, None
        return None
    if items.get("type") == "integer" and keys <= _INTEGER_KEYS:
        # Every item must be able to take another digit, or an item could be stuck
        # equal to a taken one: no bound, or only a lower bound >= 0 (positive
        # integers unbounded above), or only an upper bound <= 0. (`0` and `-0` take
        # no digit: _stuck.)
        low = [items[k] for k in ("minimum", "exclusiveMinimum") if k in items]
        high = [items[k] for k in ("maximum", "exclusiveMaximum") if k in items]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in low + high):
            return None
        if (not low and not high) or (low and not high and min(low) >= 0) \
                or (high and not low and max(high) <= 0):
            return "i", (), None
    return None


def _typed_branches(root: Any, node: dict) -> dict[str, Any] | None:
    """`anyOf`/`oneOf` whose branches each have one `type`, no two the same, and
    nothing else beside them (an `Optional[...]` field): {type: branch}, else None.
    A document value's type then tells the one branch it can be in."""
    keys = _relevant(node)
    if len(keys) != 1 or next(iter(keys)) not in ("anyOf", "oneOf"):
        return None
    out: dict[str, Any] = {}
    for branch in node[next(iter(keys))]:
        b = _deref(root, branch)
        if not isinstance(b, dict) or not isinstance(b.get("type"), str) or b["type"] in out:
            return None
        out[b["type"]] = b
    return out


def _plain(v: Any) -> bool:
    """A string every backend writes as it is (printable ASCII, no '"' or '\\')."""
    return isinstance(v, str) and all(0x20 <= ord(c) < 0x7F and c not in '"\\' for c in v)


def _discriminated(root: Any, node: dict) -> tuple[str, dict[str, dict]] | None:
    """`anyOf`/`oneOf` of objects whose first declared property is the same required
    key with a different constant string in each (a tool call's "name"): (key,
    {constant: branch}), else None. Backends write the declared order, and the
    scanner refuses any other key before this one (`step`), so the constant is read
    before any other member: it tells the branch."""
    keys = _relevant(node) - ({"type"} if node.get("type") == "object" else set())
    if len(keys) != 1 or next(iter(keys)) not in ("anyOf", "oneOf"):
        return None
    disc: str | None = None
    out: dict[str, dict] = {}
    for branch in node[next(iter(keys))]:
        b = _deref(root, branch)
        props = b.get("properties") if isinstance(b, dict) else None
        if not isinstance(props, dict) or not props:
            return None
        first = next(iter(props))
        target = _deref(root, props[first])
        value = target.get("const") if isinstance(target, dict) else None
        if isinstance(target, dict) and "const" not in target and \
                isinstance(target.get("enum"), list) and len(target["enum"]) == 1:
            value = target["enum"][0]
        if (disc is not None and first != disc) or not _plain(first) or not _plain(value) \
                or value in out or first not in (b.get("required") or []):
            return None
        disc, out[value] = first, b
    return (disc, out) if disc is not None else None


def _children(root: Any, node: dict) -> tuple[list[Any], list[Any]]:
    """(subschemas a document position reaches unambiguously, every other subschema)."""
    clean: list[Any] = []
    other: list[Any] = []
    typed = _typed_branches(root, node)
    if typed is not None:
        return list(typed.values()), []
    union = _discriminated(root, node)
    if union is not None:
        return list(union[1].values()), []
    props = node.get("properties")
    if isinstance(props, dict):
        clean += props.values()
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        (other if "patternProperties" in node else clean).append(extra)
    items = node.get("items")
    if isinstance(items, dict):
        clean.append(items)
    elif isinstance(items, list):
        other += items
    for key, value in node.items():
        if key in _STRUCTURAL or key in ("$defs", "definitions", "enum", "const") \
                or key in ANNOTATIONS:
            continue
        if isinstance(value, dict):
            if key in ("patternProperties", "dependentSchemas", "dependencies"):
                other += [v for v in value.values() if isinstance(v, dict)]
            else:
                other.append(value)
        elif isinstance(value, list):
            other += [v for v in value if isinstance(v, dict)]
    return clean, other


@dataclass
class UniquePlan:
    """The schema (its served `uniqueItems` removed) and its served array nodes."""
    schema: Any
    # id(array node) -> (item kind, enum values, string maxLength): see _item_kind
    sites: dict[int, tuple[str, tuple, int | None]] = field(default_factory=dict)
    _unions: dict[int, Any] = field(default_factory=dict)   # union() cache (engine thread)

    def union(self, node: Any) -> tuple[str, dict[str, dict]] | None:
        """`_discriminated(node)`, cached: (its key, {constant: branch}) or None."""
        if not isinstance(node, dict):
            return None
        if id(node) not in self._unions:
            self._unions[id(node)] = _discriminated(self.schema, node)
        return self._unions[id(node)]

    def child(self, node: Any, key: str | None) -> Any:
        """The schema node of a container's member: `key` in an object, an item of an
        array (key None); None where the position is not followed."""
        if not isinstance(node, dict):
            return None
        if key is None:
            items = node.get("items")
            return _deref(self.schema, items) if isinstance(items, dict) else None
        props = node.get("properties")
        if isinstance(props, dict) and key in props:
            return _deref(self.schema, props[key])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and "patternProperties" not in node:
            return _deref(self.schema, extra)
        return None


def _copy(node: Any, drop: set[int], memo: dict[int, Any]) -> Any:
    if isinstance(node, dict):
        if id(node) in memo:
            return memo[id(node)]
        out: dict = {}
        memo[id(node)] = out
        for k, v in node.items():
            if k == "uniqueItems" and id(node) in drop:
                continue
            out[k] = _copy(v, drop, memo)
        return out
    if isinstance(node, list):
        return [_copy(v, drop, memo) for v in node]
    return node


def plan(schema: Any) -> UniquePlan:
    """The served `uniqueItems` sites of `schema` (see the module docstring); the
    schema is returned unchanged (same object) when there are none."""
    if not isinstance(schema, dict) or '"uniqueItems"' not in json.dumps(schema):
        return UniquePlan(schema)
    clean_seen: set[int] = set()
    dirty_seen: set[int] = set()
    unique: dict[int, dict] = {}
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, dirty = stack.pop()
        node = _deref(schema, node)
        if not isinstance(node, dict):
            continue
        seen = dirty_seen if dirty else clean_seen
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.get("uniqueItems") is True:
            unique[id(node)] = node
        # (a `$ref`'s siblings are not followed: a site among them stays unserved)
        clean, other = _children(schema, node)
        stack += [(c, dirty) for c in clean] + [(o, True) for o in other]
    served = {nid: kind for nid, node in unique.items()
              if nid not in dirty_seen and (kind := _item_kind(schema, node)) is not None}
    if not served:
        return UniquePlan(schema)
    memo: dict[int, Any] = {}
    stripped = _copy(schema, set(served), memo)
    return UniquePlan(stripped, {id(memo[nid]): kind for nid, kind in served.items()})


# --- following the generated JSON --------------------------------------------------

class Duplicate(Exception):
    """An item equal to an earlier item of its unique array was completed."""


@dataclass(slots=True)
class _Frame:
    array: bool
    node: Any                 # schema node of this container (None: not followed)
    kind: str | None = None   # a served unique array: 's', 'i' or 'e'
    items: frozenset = frozenset()
    key: str | None = None    # object: the member being read
    want_key: bool = True     # object: the next string is a key
    values: tuple[str, ...] = ()   # 'e': the enum
    need: bool = False        # array: a ',' was read, an item must follow
    max_len: int | None = None   # 's': the items' maxLength
    disc: str | None = None   # object of a discriminated union: the key still to read


@dataclass(slots=True)
class _State:
    frames: tuple[_Frame, ...] = ()
    lex: str = ""             # "", "str", "esc", "num", "lit"
    buf: bytes = b""          # the string's raw bytes / the number's text
    key_str: bool = False     # the string being read is an object key
    track: bool = False       # the string/number is an item of a unique array
    uhex: int = 0             # hex digits of a \\u escape still to read
    disc_val: bool = False    # the string is a discriminated union's constant


def _value_node(plan_: UniquePlan, st: _State, container: str) -> Any:
    """The schema node of the array or object (`container`) starting here."""
    if not st.frames:
        node = _deref(plan_.schema, plan_.schema)
    else:
        top = st.frames[-1]
        node = plan_.child(top.node, None if top.array else top.key)
    if isinstance(node, dict):
        typed = _typed_branches(plan_.schema, node)
        if typed is not None:
            return typed.get(container)
    return node


def _with_top(st: _State, top: _Frame) -> tuple[_Frame, ...]:
    return st.frames[:-1] + (top,)


def _add_item(st: _State, value: Any) -> tuple[_Frame, ...]:
    top = st.frames[-1]
    if value in top.items:
        raise Duplicate
    return _with_top(st, _Frame(True, top.node, top.kind, top.items | {value}, values=top.values,
                                max_len=top.max_len))


def _end_number(st: _State) -> _State:
    frames = st.frames
    if st.track:
        try:
            value = json.loads(st.buf)
        except ValueError:
            value = None
        if isinstance(value, (int, float)):
            frames = _add_item(st, value)
    return _State(frames)


def step(plan_: UniquePlan, st: _State, data: bytes) -> _State:
    """The scanner's state after `data`; raises Duplicate."""
    for b in data:
        if st.lex == "str":
            if b == 0x5C:                 # backslash
                st = _State(st.frames, "esc", st.buf + b"\\", st.key_str, st.track,
                            disc_val=st.disc_val)
            elif b == 0x22:               # closing quote
                try:
                    text: Any = json.loads(b'"' + st.buf + b'"')
                except ValueError:        # not JSON (no grammar writes it): compare bytes
                    text = bytes(st.buf)
                top = st.frames[-1] if st.frames else None
                if st.key_str and top is not None:
                    if top.disc is not None and text != top.disc:
                        raise Duplicate       # another member before the union's constant
                    st = _State(_with_top(st, _Frame(False, top.node, None, top.items, text, False,
                                                     disc=top.disc)))
                elif st.disc_val and top is not None:   # the constant: now the branch is known
                    branch = plan_.union(top.node)[1].get(text)
                    st = _State(_with_top(st, _Frame(
                        False, top.node if branch is None else branch, None, top.items, top.key,
                        False, disc=top.disc if branch is None else None)))
                elif st.track:
                    st = _State(_add_item(st, text))
                else:
                    st = _State(st.frames)
            else:
                st = _State(st.frames, "str", st.buf + bytes((b,)), st.key_str, st.track,
                            disc_val=st.disc_val)
            continue
        if st.lex == "esc":
            if st.uhex:
                st = _State(st.frames, "esc" if st.uhex > 1 else "str", st.buf + bytes((b,)),
                            st.key_str, st.track, st.uhex - 1, st.disc_val)
            else:
                st = _State(st.frames, "esc" if b == ord("u") else "str", st.buf + bytes((b,)),
                            st.key_str, st.track, 4 if b == ord("u") else 0, st.disc_val)
            continue
        if st.lex == "num":
            if b in _DELIMITERS:
                st = _end_number(st)   # then the delimiter below
            else:
                st = _State(st.frames, "num", st.buf + bytes((b,)), track=st.track)
                continue
        if st.lex == "lit":
            if 0x61 <= b <= 0x7A:             # true / false / null letters
                continue
            st = _State(st.frames)
        top = st.frames[-1] if st.frames else None
        if b == 0x22:                         # a string starts: a key or a value
            if top is not None and not top.array and top.want_key:
                st = _State(st.frames, "str", b"", key_str=True)
            elif top is not None and not top.array and top.disc is not None \
                    and top.key == top.disc:
                st = _State(st.frames, "str", b"", disc_val=True)
            else:
                st = _State(st.frames, "str", b"",
                            track=top is not None and top.kind in ("s", "e"))
        elif b in b"{[":
            node = _value_node(plan_, st, "array" if b == 0x5B else "object")
            if b == 0x5B:
                kind, values, most = plan_.sites.get(id(node), (None, (), None))
                st = _State(st.frames + (_Frame(True, node, kind, values=values, max_len=most),))
            else:
                union = plan_.union(node)
                st = _State(st.frames + (_Frame(False, node, disc=union and union[0]),))
        elif b in b"}]":
            st = _State(st.frames[:-1])
        elif b == 0x2C and top is not None and not top.array:     # ',' in an object
            st = _State(_with_top(st, _Frame(False, top.node, None, top.items, None, True,
                                             disc=top.disc)))
        elif b == 0x2C and top is not None and top.kind is not None:   # ',' in a unique array
            st = _State(_with_top(st, _Frame(True, top.node, top.kind, top.items,
                                             values=top.values, need=True, max_len=top.max_len)))
        elif b == 0x2D or 0x30 <= b <= 0x39:  # '-' or a digit: a number starts
            st = _State(st.frames, "num", bytes((b,)),
                        track=top is not None and top.kind in ("i", "e"))
        elif 0x61 <= b <= 0x7A:
            st = _State(st.frames, "lit")
        # ':' and whitespace change nothing
    return st


def _stuck(st: _State) -> bool:
    """Whether every way on from `st` repeats an item: a unique integer that can only
    end as 0 (after '0' / '-0') with 0 taken; an enum item whose bytes so far begin
    only taken values, or a ',' with every value taken."""
    if not st.frames:
        return False
    top = st.frames[-1]
    if top.disc is not None and st.key_str and st.lex in ("str", "esc"):
        return not top.disc.encode().startswith(st.buf)   # only the union's key may come
    if top.kind is None:
        return False
    if top.kind == "i":
        return st.lex == "num" and st.buf in (b"0", b"-0") and 0 in top.items
    if top.kind == "s":
        if top.max_len is None or st.lex != "str" or not st.track:
            return False
        try:       # a character still incomplete: any other last byte keeps it new
            text = json.loads(b'"' + st.buf + b'"')
        except ValueError:
            return False
        return len(text) == top.max_len and text in top.items
    if top.kind == "e":
        if st.lex in ("str", "esc", "num"):
            number = st.lex == "num"
            return not any(isinstance(v, int) == number and str(v).encode().startswith(st.buf)
                           for v in top.values if v not in top.items)
        if top.need and not st.lex:
            return all(v in top.items for v in top.values)
    return False


def _follows(plan_: UniquePlan, st: _State, data: bytes) -> _State | None:
    """The state after `data`, or None if it completes (or must complete) a duplicate."""
    try:
        out = step(plan_, st, data)
    except Duplicate:
        return None
    return None if _stuck(out) else out


# --- what the matcher wrapper follows: one document, or the tags of free text ----

class DocScan:
    """The output is one JSON document of `plan_`'s schema (a `json` constraint)."""

    def __init__(self, plan_: UniquePlan):
        self.plan = plan_

    def initial(self) -> _State:
        return _State()

    def follows(self, st: _State, data: bytes) -> _State | None:
        return _follows(self.plan, st, data)

    def json(self, st: _State) -> _State | None:
        """The JSON scanner's state (for the mask's candidate tokens)."""
        return st


@dataclass(frozen=True, slots=True)
class _Seg:
    tail: bytes = b""            # free text: its last bytes (where a tag's begin shows)
    tag: int = -1                # inside the JSON value of tags[tag] (-1: free text)
    st: _State | None = None     # ... its scanner state
    started: bool = False        # ... its first byte (not whitespace) was read


class TagScan:
    """Free text in which each tag's `begin` opens a JSON value of that tag's schema
    (tool calls under `tool_choice: "auto"`: `<tool_call>\n{"name": "f", "arguments": `
    then the arguments). The grammar forces every begin after its trigger, so a begin
    in the text is where a value starts; a raw begin cannot sit inside a JSON value
    (its newline would be escaped there). Each value is followed with its tag's plan
    until it is complete, then the text is free again."""

    def __init__(self, tags: list[tuple[str, UniquePlan]]):
        self.tags = [(begin.encode(), p) for begin, p in tags]
        self._keep = max(len(b) for b, _ in self.tags)

    def initial(self) -> _Seg:
        return _Seg()

    def json(self, seg: _Seg) -> _State | None:
        return seg.st if seg.tag >= 0 else None

    def follows(self, seg: _Seg, data: bytes) -> _Seg | None:
        try:
            for b in data:
                seg = self._byte(seg, b)
        except Duplicate:
            return None
        return None if seg.tag >= 0 and _stuck(seg.st) else seg

    def _byte(self, seg: _Seg, b: int) -> _Seg:
        if seg.tag < 0:
            tail = (seg.tail + bytes((b,)))[-self._keep:]
            for i, (begin, _) in enumerate(self.tags):
                if tail.endswith(begin):
                    return _Seg(b"", i, _State())
            return _Seg(tail)
        st = step(self.tags[seg.tag][1], seg.st, bytes((b,)))
        started = seg.started or b not in b" \t\n\r"
        if started and not st.frames and not st.lex:
            return _Seg()                         # the value is complete: free text
        return _Seg(b"", seg.tag, st, started)
