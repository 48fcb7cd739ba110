"""Exact rewrites that let the backends enforce more schemas.

xgrammar ignores keywords next to allOf/anyOf/oneOf and enforces only single-
branch allOf. Two rewrites keep the meaning of the schema exactly and remove
those shapes where possible:
- `{S, allOf: [B1..Bn]}` -> `merge(S, B1, ..., Bn)` (local `$ref` branches inlined);
- `{S, anyOf|oneOf: [B1..Bn]}` -> `{anyOf|oneOf: [merge(S, B1), ...]}`: x satisfies
  S and (exactly) one Bi iff x satisfies (exactly) one `S and Bi`.
`merge` gives up (returns None) whenever a plain union of keywords would not
mean "both": keywords that interact across the two schemas (patternProperties
with additionalProperties, items with prefixItems, if/then/else, ...) or the
same keyword with different values it cannot combine. It does combine
`properties` into a side with additionalProperties (a name only the other side
declares gets both schemas), two `not`s, and drops vacuous `{}` members.
Each node also goes through the one-node rewrites of `schema_rewrites`; a last
pass only splits untyped nodes (`split_typeless`), once anyOf/oneOf siblings
have been pushed down. The input is not mutated.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from formwork.grammar.schema_oneof import inferred_types
from formwork.grammar.schema_rewrites import (
    complete_array,
    declare_required,
    drop_inapplicable,
    expand_dependencies,
    filter_enum,
    forbid_property,
    fold_pattern_lengths,
    split_typeless,
)
from formwork.grammar.schema_walk import is_legacy_draft, resolve_local_ref, validator_class

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema"})
_STAY = ANNOTATIONS | {"$defs", "definitions"}   # never pushed into branches
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT_GROUP = frozenset({"properties", "patternProperties", "additionalProperties",
                           "unevaluatedProperties", "propertyNames"})
_ARRAY_GROUP = frozenset({"items", "prefixItems", "additionalItems", "unevaluatedItems",
                          "contains"})
_VACUOUS = frozenset({"additionalProperties", "propertyNames", "items", "additionalItems"})
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
    if key == "not":                       # (not A) and (not B) = not (A or B)
        return True, {"anyOf": [va, vb]}
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


def _properties_into_additional(a: dict, b: dict, legacy: bool) -> tuple[dict, dict] | None:
    """(a, b) with the `properties` of one side moved into the other when that
    other side's object keywords are additionalProperties (and properties): a
    name only the moved side declares was governed by additionalProperties, so
    it gets both schemas (or stays forbidden). None if a merge fails."""
    for x, y in ((a, b), (b, a)):
        xg, yg = _OBJECT_GROUP & x.keys(), _OBJECT_GROUP & y.keys()
        if yg != {"properties"} or xg not in ({"additionalProperties"},
                                              {"properties", "additionalProperties"}):
            continue
        extra, props = x["additionalProperties"], x.get("properties", {})
        if not isinstance(props, dict) or not isinstance(y["properties"], dict):
            return None
        props = dict(props)
        for name, sy in y["properties"].items():
            if name not in props and extra is False:
                continue
            m = merge(props.get(name, {} if extra is True else extra), sy, legacy)
            if m is None:
                return None
            props[name] = m
        return dict(x, properties=props), {k: v for k, v in y.items() if k != "properties"}
    return a, b


def _drop_vacuous(node: dict, group: frozenset[str], other: dict) -> dict:
    """`node` without the members of `group` that constrain nothing (`{}`/true),
    unless an unevaluated* keyword on either side could see their annotations."""
    if {"unevaluatedProperties", "unevaluatedItems"} & (node.keys() | other.keys()):
        return node
    return {k: v for k, v in node.items()
            if not (k in group and k in _VACUOUS and v in (True, {}))}


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
        if group & a.keys() and group & b.keys():
            a, b = _drop_vacuous(a, group, b), _drop_vacuous(b, group, a)
    pair = _properties_into_additional(a, b, legacy)
    if pair is None:
        return None
    a, b = pair
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


@dataclass(frozen=True, slots=True)
class _Ctx:
    root: Any
    legacy: bool
    validator: Any              # jsonschema validator over `root`
    known: frozenset[str]       # keywords `root`'s draft defines
    final: bool = False         # the last pass: only `split_typeless`

    def merge(self, a: Any, b: Any) -> dict | None:
        return merge(a, b, self.legacy)


def _rewrite_keywords(node: dict, ctx: _Ctx) -> dict | bool:
    if ctx.final:
        return split_typeless(node, _STAY)
    out = filter_enum(node, ctx.validator)
    if out is False:
        return False
    out = fold_pattern_lengths(declare_required(complete_array(drop_inapplicable(out))))
    return expand_dependencies(out, ctx.known, ctx.merge, _STAY)


def _rewrite(node: dict, ctx: _Ctx) -> dict | bool:
    root, legacy = ctx.root, ctx.legacy
    if isinstance(node.get("allOf"), list) and not ctx.final:
        merged: Any = {k: v for k, v in node.items() if k != "allOf"}
        for branch in node["allOf"]:
            if merged is not None:
                merged = merge(merged, _resolve(branch, root), legacy)
        if merged is not None and "allOf" not in merged:
            node = merged
    out = _rewrite_keywords(node, ctx)
    if not isinstance(out, dict):
        return out
    node = out
    for kw in ("anyOf", "oneOf"):
        rest = {k: v for k, v in node.items() if k != kw and k not in _STAY}
        if isinstance(node.get(kw), list) and rest and not ctx.final:
            branches = [merge(rest, _resolve(b, root), legacy) for b in node[kw]]
            if all(b is not None for b in branches):
                node = {k: v for k, v in node.items() if k in _STAY} | {kw: branches}
    return node


def _normalize(node: Any, ctx: _Ctx, depth: int) -> Any:
    if not isinstance(node, dict) or depth > 64:
        return node
    out = dict(node)
    if ctx.legacy and "$ref" in node:      # drafts 3-7: `$ref` siblings mean nothing
        out = {k: v for k, v in node.items() if k == "$ref" or k in _STAY}
    names = out.get("propertyNames")
    if isinstance(names, dict) and "$ref" not in names and inferred_types(names) is None:
        out["propertyNames"] = names | {"type": "string"}   # names are strings
    for key in _CHILD_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _normalize(v, ctx, depth + 1) for k, v in out[key].items()}
    out = _forbid_impossible(out, node)
    for key in _CHILD_ONE:
        if key in out:
            out[key] = _normalize(out[key], ctx, depth + 1)
    for key in _CHILD_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_normalize(v, ctx, depth + 1) for v in out[key]]
    return _rewrite(out, ctx)


def _forbid_impossible(out: dict, node: dict) -> dict:
    """Properties whose schema became `false` (xgrammar refuses it) are forbidden
    instead, or get their original schema back (and stay flagged)."""
    props = out.get("properties")
    if not isinstance(props, dict) or False not in props.values():
        return out
    for name in [k for k, v in props.items() if v is False and node["properties"][k] is not False]:
        forbidden = forbid_property(out, name)
        if forbidden is None:
            out = dict(out, properties=out["properties"] | {name: node["properties"][name]})
        else:
            out = forbidden
    return out


def map_subschemas(schema: Any, fn: Callable[[dict], Any]) -> Any:
    """`schema` with `fn` applied to every subschema object, children first;
    `schema` itself (not a copy) when `fn` changed nothing."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _CHILD_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: map_subschemas(v, fn) for k, v in out[key].items()}
    for key in _CHILD_ONE:
        if key in out:
            out[key] = map_subschemas(out[key], fn)
    for key in _CHILD_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [map_subschemas(v, fn) for v in out[key]]
    out = fn(out)
    return schema if out == schema else out


def _context(root: dict, final: bool = False) -> _Ctx:
    cls = validator_class(root)
    return _Ctx(root, is_legacy_draft(root), cls(root), frozenset(cls.VALIDATORS), final)


def normalize(schema: Any) -> Any:
    """An equivalent schema with allOf merged, anyOf/oneOf siblings pushed into
    the branches and the `schema_rewrites` applied where that is exact; `schema`
    itself if nothing changed."""
    if not isinstance(schema, dict):
        return schema
    out = _normalize(schema, _context(schema), 0)
    if isinstance(out, dict):              # again: `$ref` targets are normalized now
        out = _normalize(out, _context(out), 0)
    if isinstance(out, dict):
        out = _normalize(out, _context(out, final=True), 0)
    return schema if json.dumps(out, sort_keys=True) == json.dumps(schema, sort_keys=True) \
        else out
