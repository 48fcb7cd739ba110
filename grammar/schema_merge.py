"""`merge(a, b)`: one schema meaning `allOf: [a, b]`, or None when a plain union
of keywords would not mean "both" (keywords that interact across the two
schemas: patternProperties with additionalProperties, items with prefixItems,
if/then/else, ...; the same keyword with values it cannot combine). It combines
`type`s, bounds, `required`, two `not`s, enum/const (their common values),
`properties` (also into a side with additionalProperties: a name only the other
side declares gets both schemas), `false` properties, and drops vacuous `{}`
members. Inputs are not mutated.
"""
from __future__ import annotations

from typing import Any

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema"})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT_GROUP = frozenset({"properties", "patternProperties", "additionalProperties",
                           "unevaluatedProperties", "propertyNames"})
_ARRAY_GROUP = frozenset({"items", "prefixItems", "additionalItems", "unevaluatedItems",
                          "contains"})
_VACUOUS = frozenset({"additionalProperties", "propertyNames", "items", "additionalItems"})


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
            if False in (out.get(name), sb):   # a forbidden property stays forbidden
                out[name] = False
                continue
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
            if sy is False or props.get(name) is False:   # forbidden either way
                props[name] = False
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
    if {"const", "enum"} & a.keys() and {"const", "enum"} & b.keys():
        values = _common_values(a, b)
        if values is None:
            return None
        a, b = _without_values(a) | {"enum": values}, _without_values(b)
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


def json_equal(x: Any, y: Any) -> bool:
    """Equality as JSON Schema's enum/const see it: 1 == 1.0, true != 1."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(json_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(json_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _values_of(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]] if "enum" not in node else None
    return node["enum"] if isinstance(node["enum"], list) else None


def _common_values(a: dict, b: dict) -> list | None:
    """The values of `a`'s enum/const that `b`'s also lists ([] if none), or None
    when either side has both keywords or a malformed enum."""
    va, vb = _values_of(a), _values_of(b)
    if va is None or vb is None:
        return None
    return [x for x in va if any(json_equal(x, y) for y in vb)]


def _without_values(node: dict) -> dict:
    return {k: v for k, v in node.items() if k not in ("const", "enum")}
