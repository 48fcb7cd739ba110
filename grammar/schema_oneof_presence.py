"""A oneOf whose branches differ only in which properties are present, as an anyOf.

`{oneOf: [{required: [radius], not: {required: [width, height]}}, {required:
[width, height], not: {required: [radius]}}]}` on one object: after `schema_not`
each branch is an anyOf of closed objects ("leaves") that agree on every
property schema and keyword and differ only in `required` and in which names
they leave out. Whether an object meets a branch then depends only on which of
the names K (required somewhere, or left out somewhere) it has. For every
subset S of K met by exactly one branch, one leaf: the names of S required, the
rest of K left out. The anyOf of those leaves admits exactly the objects the
oneOf admits. At most 2**MAX_NAMES subsets; anything else is left alone.
"""
from __future__ import annotations

import itertools
from typing import Any

MAX_NAMES = 6
_LEAF_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
_BLOCKING = frozenset({"patternProperties", "unevaluatedProperties", "propertyNames",
                       "minProperties", "maxProperties", "dependencies", "dependentRequired",
                       "dependentSchemas", "allOf", "anyOf", "oneOf", "not", "if", "$ref",
                       "enum", "const"})


def _leaves(branch: Any, stay: frozenset[str]) -> list | None:
    if isinstance(branch, dict) and isinstance(branch.get("anyOf"), list) and \
            set(branch) - stay == {"anyOf"}:
        return branch["anyOf"]
    return [branch]


def _leaf(node: Any, stay: frozenset[str]) -> tuple[dict, list, dict] | None:
    """(properties, required, other keywords) of a closed object leaf, or None."""
    if not isinstance(node, dict) or node.get("type") != "object" or \
            node.get("additionalProperties") is not False or _BLOCKING & node.keys():
        return None
    props, req = node.get("properties", {}), node.get("required", [])
    if not isinstance(props, dict) or not isinstance(req, list) or \
            not all(isinstance(r, str) and r in props for r in req):
        return None
    return props, req, {k: v for k, v in node.items() if k not in _LEAF_KEYS and k not in stay}


def presence_one_of(branches: list, stay: frozenset[str]) -> list | None:
    """anyOf branches meaning the oneOf of `branches`, or None."""
    parsed = []
    for branch in branches:
        leaves = _leaves(branch, stay)
        if not leaves:
            return None
        parsed.append([_leaf(x, stay) for x in leaves])
        if None in parsed[-1]:
            return None
    leaves_all = [leaf for p in parsed for leaf in p]
    found: dict[str, Any] = {}
    order: list[str] = []
    for props, _, other in leaves_all:
        if other != leaves_all[0][2]:
            return None
        for name, schema in props.items():
            if found.setdefault(name, schema) != schema:
                return None
        _merge_order(order, list(props))
    schemas = {name: found[name] for name in order}   # the leaves' common property order
    names = [n for n in schemas if any(n in r or n not in p for p, r, _ in leaves_all)]
    if len(names) > MAX_NAMES:
        return None
    out = []
    for bits in itertools.product((False, True), repeat=len(names)):
        present = {n for n, b in zip(names, bits) if b}
        met = sum(any(set(r) <= present and present <= set(p) | (schemas.keys() - set(names))
                      for p, r, _ in leaves) for leaves in parsed)
        if met == 1:
            props = {n: s for n, s in schemas.items() if n in present or n not in names}
            out.append(leaves_all[0][2] | {"type": "object", "properties": props,
                                            "required": [n for n in names if n in present],
                                            "additionalProperties": False})
    return out or None


def _merge_order(order: list[str], names: list[str]) -> None:
    """Insert the new `names` into `order`, each right after its predecessor in `names`."""
    for i, name in enumerate(names):
        if name not in order:
            before = next((order.index(n) + 1 for n in reversed(names[:i]) if n in order), 0)
            order.insert(before, name)
