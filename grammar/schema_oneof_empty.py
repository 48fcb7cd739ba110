"""oneOf branches that overlap in a few values, rewritten so they do not (exact).

An instance valid against two branches of a oneOf is invalid, so no branch
needs to generate it:

An instance valid against two branches of a oneOf is invalid. When two or more
branches certainly admit `{}` (object-only, nothing that requires a property),
`{}` is invalid, and every object-only branch may say so (`minProperties: 1`);
likewise `[]` and `minItems: 1`. The oneOf keeps its meaning exactly, and
`schema_oneof` can then often prove the branches disjoint (closed objects with
no common property; arrays whose items exclude each other).
`separate_listed_strings`: `oneOf: [{enum: ["vim", ...]}, {type: string}]`
admits exactly the strings not listed: the list loses them, the string branch
gets a pattern excluding them.
"""
from __future__ import annotations

from typing import Any

from formwork.grammar.schema_oneof import inferred_types
from formwork.grammar.schema_rules import ASSERTIONS as _ASSERTING

# Keywords that may reject the empty object/array (or whose effect is not judged here).
_OBJECT_GUARDS = frozenset({"required", "minProperties", "dependentSchemas", "dependencies",
                            "unevaluatedProperties"})
_ARRAY_GUARDS = frozenset({"minItems", "contains", "minContains", "unevaluatedItems"})
_OPAQUE = frozenset({"anyOf", "oneOf", "allOf", "$ref", "not", "if", "enum", "const",
                     "$dynamicRef", "$recursiveRef"})
_EMPTY = (("object", _OBJECT_GUARDS, "minProperties", {}), ("array", _ARRAY_GUARDS, "minItems", []))


def _only(branch: Any, kind: str) -> bool:
    return isinstance(branch, dict) and inferred_types(branch) == {kind}


def _admits_empty(branch: Any, guards: frozenset[str], bound: str) -> bool:
    """Certainly admits the empty value (False when unsure)."""
    if _OPAQUE & branch.keys():
        return False
    for kw in guards & branch.keys():
        value = branch[kw]
        if kw == "required" and value == []:
            continue
        if kw == bound and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value <= 0:
            continue
        return False
    return True


def separate_empty(branches: list) -> list | None:
    """`branches` (local refs already resolved) with the empty object/array excluded
    from every branch of its type when two or more certainly admit it; None if
    nothing changes."""
    out, changed = list(branches), False
    for kind, guards, bound, _ in _EMPTY:
        typed = [i for i, b in enumerate(out) if _only(b, kind)]
        if sum(_admits_empty(out[i], guards, bound) for i in typed) < 2:
            continue
        for i in typed:
            current = out[i].get(bound)
            if not (isinstance(current, (int, float)) and current >= 1):
                out[i] = out[i] | {bound: 1}
                changed = True
    return out if changed else None


# --- listed strings that a plain string branch also admits ------------------------------

_PLAIN_STRING = frozenset({"type", "minLength", "maxLength"})
MAX_EXCLUDED = 64


def _escape(ch: str) -> str:
    """One code point as a regex atom both Python's re and Rust's regex read alike."""
    if ch.isascii() and ch.isalnum():
        return ch
    cp = ord(ch)
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def _trie_regex(trie: dict) -> str:
    """Strings that are none of the words below this trie node (key "" marks a word end)."""
    children = sorted(k for k in trie if k)
    alts = [] if "" in trie else [""]                     # stop here: not a word
    other = "".join(_escape(c) for c in children)
    alts.append(f"[^{other}][\\s\\S]*" if other else "[\\s\\S]+")
    alts += [_escape(c) + f"(?:{_trie_regex(trie[c])})" for c in children]
    return "|".join(alts)


def excluding_pattern(words: list[str]) -> str:
    """An anchored pattern matching every string except `words`."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}
    return f"^(?:{_trie_regex(trie)})$"


def _plain_string(branch: Any) -> bool:
    return isinstance(branch, dict) and inferred_types(branch) == {"string"} and \
        not {k for k in branch if k in _ASSERTING} - _PLAIN_STRING


def separate_listed_strings(branches: list, validator: Any) -> list | None:
    """`branches` (local refs resolved) where an enum/const branch lists strings a
    plain string branch (type string, lengths at most) also admits, and no third
    branch does: such a string is invalid (two branches), so it leaves the list
    and the string branch gets a pattern excluding it. Exact. None if nothing
    changes or a string is admitted by a third branch."""
    strings = [i for i, b in enumerate(branches) if _plain_string(b)]
    if len(strings) != 1:
        return None
    s = strings[0]
    out, excluded = list(branches), []
    for i, b in enumerate(branches):
        values = _listed(b)
        if i == s or values is None:
            continue
        try:
            both = [v for v in values if validator.evolve(schema=branches[s]).is_valid(v)]
            third = any(validator.evolve(schema=c).is_valid(v) for v in both
                        for j, c in enumerate(branches) if j not in (i, s))
        except Exception:                  # unresolvable ref, odd regex: leave it
            return None
        if third:
            return None
        keep = [v for v in values if v not in both]
        out[i] = {k: v for k, v in b.items() if k not in ("enum", "const")} | {"enum": keep}
        excluded += both
    if not excluded or len(excluded) > MAX_EXCLUDED:
        return None
    out[s] = out[s] | {"pattern": excluding_pattern(list(dict.fromkeys(excluded)))}
    return [b for b in out if b.get("enum") != []]


def _listed(branch: Any) -> list | None:
    if not isinstance(branch, dict) or {k for k in branch if k in _ASSERTING} - {"enum", "const", "type"}:
        return None
    if "const" in branch:
        return [branch["const"]] if "enum" not in branch else None
    return branch["enum"] if isinstance(branch.get("enum"), list) else None
