"""Exact rewrites that let the backends enforce more schemas.

xgrammar ignores keywords next to allOf/anyOf/oneOf and enforces only single-
branch allOf. Two rewrites keep the meaning of the schema exactly and remove
those shapes where possible:
- `{S, allOf: [B1..Bn]}` -> `merge(S, B1, ..., Bn)` (local `$ref` branches inlined);
- `{S, anyOf|oneOf: [B1..Bn]}` -> `{anyOf|oneOf: [merge(S, B1), ...]}`: x satisfies
  S and (exactly) one Bi iff x satisfies (exactly) one `S and Bi`.
`merge` gives up (returns None) whenever a plain union of keywords would not
mean "both": keywords that interact across the two schemas (properties with
additionalProperties, items with prefixItems, if/then/else, ...) or the same
keyword with different values it cannot combine. The input is not mutated.
"""
from __future__ import annotations

import json
from typing import Any

from grammar.schema_walk import is_legacy_draft, resolve_local_ref

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema"})
_STAY = ANNOTATIONS | {"$defs", "definitions"}   # never pushed into branches
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT_GROUP = frozenset({"properties", "patternProperties", "additionalProperties",
                           "unevaluatedProperties", "propertyNames"})
_ARRAY_GROUP = frozenset({"items", "prefixItems", "additionalItems", "unevaluatedItems",
                          "contains"})
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_CHILD_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if",
              "then", "else", "unevaluatedProperties", "unevaluatedItems")
_CHILD_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _intersect_types(a: Any, b: Any) -> list[str] | None:
    ta, tb = ([a] if isinstance(a, str) else a), ([b] if isinstance(b, str) else b)
    out = []
    for t in ta:
        if t in tb or (t == "integer" and "number" in tb):
            out.append(t)
        elif t == "number" and "integer" in tb:
            out.append("integer")
    return list(dict.fromkeys(out)) or None


def _merge_key(key: str, va: Any, vb: Any, legacy: bool) -> tuple[bool, Any]:
    """(ok, merged value) for a keyword present in both schemas."""
    if va == vb or key in ANNOTATIONS:
        return True, va
    if key == "type":
        t = _intersect_types(va, vb)
        return t is not None, (t[0] if t and len(t) == 1 else t)
    if key == "required" and isinstance(va, list) and isinstance(vb, list):
        return True, list(dict.fromkeys(va + vb))
    if key == "properties" and isinstance(va, dict) and isinstance(vb, dict):
        out = dict(va)
        for name, sb in vb.items():
            m = merge(out[name], sb, legacy) if name in out else sb
            if m is None:
                return False, None
            out[name] = m
        return True, out
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
    if numbers and key in _LOWER:
        return True, max(va, vb)
    if numbers and key in _UPPER:
        return True, min(va, vb)
    return False, None


def merge(a: Any, b: Any, legacy: bool = False) -> dict | None:
    """A schema meaning `allOf: [a, b]` made of one object, or None. In drafts 3-7
    (`legacy`) keywords next to `$ref` are ignored, so nothing merges into one."""
    if a is True or a == {}:
        return b if isinstance(b, dict) else {} if b is True else None
    if b is True or b == {}:
        return a if isinstance(a, dict) else None
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    if ("$ref" in a and "$ref" in b) or (legacy and ("$ref" in a or "$ref" in b)):
        return None
    if any(k in a and k in b for k in ("if", "then", "else")):
        return None
    if {"const", "enum"} & a.keys() and {"const", "enum"} & b.keys() and \
            (a.get("const"), a.get("enum")) != (b.get("const"), b.get("enum")):
        return None
    for group in (_OBJECT_GROUP, _ARRAY_GROUP):
        ga, gb = group & a.keys(), group & b.keys()
        if ga and gb and not (ga == gb == {"properties"}) and \
                any(a.get(k) != b.get(k) for k in ga | gb):
            return None
    out = dict(a)
    for key, vb in b.items():
        if key in out:
            ok, value = _merge_key(key, out[key], vb, legacy)
            if not ok:
                return None
            out[key] = value
        else:
            out[key] = vb
    return out


def _resolve(branch: Any, root: Any) -> Any:
    """A branch that is only a local `$ref` stands for its target."""
    if isinstance(branch, dict) and set(branch) - ANNOTATIONS == {"$ref"}:
        target = resolve_local_ref(root, branch["$ref"])
        if target is not None and target[0] is not root:
            return target[0]
    return branch


def _rewrite(node: dict, root: Any, legacy: bool) -> dict:
    if isinstance(node.get("allOf"), list):
        merged: Any = {k: v for k, v in node.items() if k != "allOf"}
        for branch in node["allOf"]:
            if merged is not None:
                merged = merge(merged, _resolve(branch, root), legacy)
        if merged is not None and "allOf" not in merged:
            node = merged
    for kw in ("anyOf", "oneOf"):
        rest = {k: v for k, v in node.items() if k != kw and k not in _STAY}
        if isinstance(node.get(kw), list) and rest:
            branches = [merge(rest, _resolve(b, root), legacy) for b in node[kw]]
            if all(b is not None for b in branches):
                node = {k: v for k, v in node.items() if k in _STAY} | {kw: branches}
    return node


def _normalize(node: Any, root: Any, legacy: bool, depth: int) -> Any:
    if not isinstance(node, dict) or depth > 64:
        return node
    out = dict(node)
    if legacy and "$ref" in node:          # drafts 3-7: `$ref` siblings mean nothing
        out = {k: v for k, v in node.items() if k == "$ref" or k in _STAY}
    for key in _CHILD_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _normalize(v, root, legacy, depth + 1) for k, v in out[key].items()}
    for key in _CHILD_ONE:
        if key in out:
            out[key] = _normalize(out[key], root, legacy, depth + 1)
    for key in _CHILD_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_normalize(v, root, legacy, depth + 1) for v in out[key]]
    return _rewrite(out, root, legacy)


def normalize(schema: Any) -> Any:
    """An equivalent schema with allOf merged and anyOf/oneOf siblings pushed into
    the branches where that is exact; `schema` itself if nothing changed."""
    if not isinstance(schema, dict):
        return schema
    legacy = is_legacy_draft(schema)
    out = _normalize(schema, schema, legacy, 0)
    out = _normalize(out, out, legacy, 0)    # again: `$ref` targets are normalized now
    return schema if json.dumps(out, sort_keys=True) == json.dumps(schema, sort_keys=True) \
        else out
