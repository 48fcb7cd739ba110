"""`not` rewrites behind `schema_normalize`: no backend enforces `not`, but its
common shapes say only which properties an object must lack.

- `not: {}` / `not: true` (nothing is valid) -> `false`; `not: false` is dropped.
- On a node whose only type is `object`, `not S` where S is made of `required`
  (through anyOf / allOf of such) means clauses "at least one of these names
  is absent": `not {required: [a, b]}` -> a absent or b absent;
  `not {anyOf: [{required: [a]}, {required: [b]}]}` -> a absent and b absent.
  The node becomes an anyOf over the ways to meet every clause, each branch the
  node with the chosen names forbidden (`forbid_property`); a name the node
  requires cannot be chosen, and when no way is left the node is `false`.
  Exact for a backend that enforces `properties: {name: false}`
  (`forbid_property_exactly`); for xgrammar forbidding a name closes an object
  that said nothing about other properties (stricter: see `forbid_property`). At most
  `MAX_NOT_BRANCHES` branches, else the node is left alone (and stays flagged).
Inputs are not mutated.
"""
from __future__ import annotations

import itertools
from typing import Any

from formwork.grammar.schema_oneof import inferred_types
from formwork.grammar.schema_rewrites import Forbid, forbid_property
from formwork.grammar.schema_rules import ASSERTIONS

MAX_NOT_BRANCHES = 8
_MAX_CLAUSES = 16


def _assertions(node: dict) -> set[str]:
    return {k for k in node if k in ASSERTIONS}


def _vacuous(schema: Any) -> bool:
    return schema is True or (isinstance(schema, dict) and not _assertions(schema))


def _required_only(sub: dict) -> list[str] | None:
    """The names of `{required: [...]}` (declared with vacuous schemas or a
    `type` that admits objects, as the normalizer may leave it), else None."""
    keys, req = _assertions(sub), sub.get("required")
    if "required" not in keys or not isinstance(req, list) or \
            not all(isinstance(r, str) for r in req) or keys - {"required", "type", "properties"}:
        return None
    types = inferred_types(sub)
    props = sub.get("properties", {})
    if (types is not None and "object" not in types) or not isinstance(props, dict) or \
            not all(_vacuous(v) for v in props.values()):
        return None
    return list(dict.fromkeys(req))


def _never_object(sub: Any) -> bool:
    """`sub` admits no object (its `type` excludes it)."""
    types = inferred_types(sub) if isinstance(sub, dict) else None
    return sub is False or (types is not None and "object" not in types
                            and "properties" not in sub)


def absent_clauses(sub: Any) -> list[list[str]] | None:
    """`not sub`, on objects, as clauses (each: one of these names is absent), or
    None if `sub` is not of a handled shape. [] means `not sub` holds for every object."""
    if _never_object(sub):
        return []
    if not isinstance(sub, dict):
        return None
    names = _required_only(sub)
    if names is not None:
        return [names] if names else None          # `required: []` holds: not -> nothing
    keys = _assertions(sub)
    if keys == {"anyOf"} and isinstance(sub["anyOf"], list):   # not (A or B) = not A and not B
        clauses: list[list[str]] = []
        for branch in sub["anyOf"]:
            more = absent_clauses(branch)
            if more is None:
                return None
            clauses += more
        return clauses
    if keys == {"allOf"} and isinstance(sub["allOf"], list):   # not (A and B) = not A or not B
        parts = [_required_only(b) if isinstance(b, dict) else None for b in sub["allOf"]]
        if parts and all(p for p in parts):
            return [list(dict.fromkeys(n for p in parts for n in p))]   # type: ignore[union-attr]
    return None


def _branches(node: dict, clauses: list[list[str]], forbid: Forbid) -> list[dict] | None:
    required = node.get("required", [])
    options = [[n for n in c if n not in required] for c in clauses]
    choices = 1
    for o in options:
        choices *= max(1, len(o))
    if choices > 4 * MAX_NOT_BRANCHES:
        return None
    out: list[dict] = []
    for pick in itertools.product(*options):   # no product when an option is empty
        branch: Any = node
        for name in dict.fromkeys(pick):
            branch = forbid(branch, name)
            if branch is None:
                return None
        if branch not in out:
            out.append(branch)
    return out


def rewrite_not(node: dict, stay: frozenset[str], forbid: Forbid = forbid_property) -> dict | bool:
    """`stay`: keys (annotations, definitions) kept on the outer node; `forbid(node,
    name)`: `node` without property `name`, or None."""
    if "not" not in node:
        return node
    sub, rest = node["not"], {k: v for k, v in node.items() if k != "not"}
    if sub is False:
        return rest
    if _vacuous(sub):
        return False
    clauses = absent_clauses(sub)
    if clauses is None or len(clauses) > _MAX_CLAUSES or inferred_types(node) != {"object"} or \
            {"anyOf", "oneOf", "allOf", "$ref", "if"} & rest.keys() or \
            not isinstance(rest.get("required", []), list):
        return node
    # `not {required: ...}` refuses every non-object: the type is stated, not inferred
    inner = {k: v for k, v in rest.items() if k not in stay} | {"type": "object"}
    branches = _branches(inner, clauses, forbid)
    if branches is None or len(branches) > MAX_NOT_BRANCHES:
        return node
    if not branches:
        return False
    outer = {k: v for k, v in rest.items() if k in stay}
    return outer | branches[0] if len(branches) == 1 else outer | {"anyOf": branches}
