"""Exact rewrites that let the backends enforce more schemas.

xgrammar ignores keywords next to allOf/anyOf/oneOf and enforces only single-
branch allOf. Two rewrites keep the meaning of the schema exactly and remove
those shapes where possible (`merge`: grammar/schema_merge.py):
- `{S, allOf: [B1..Bn]}` -> `merge(S, B1, ..., Bn)` (local `$ref` branches inlined);
- `{S, anyOf|oneOf: [B1..Bn]}` -> `{anyOf|oneOf: [merge(S, B1), ...]}`: x satisfies
  S and (exactly) one Bi iff x satisfies (exactly) one `S and Bi`.
Each node also goes through the one-node rewrites of `schema_rewrites` and
`schema_not`, if/then/else on a listed discriminator (`schema_ifthen`), and
oneOf branches lose the values two of them share (`schema_oneof_empty`) or
become an anyOf over which properties are present (`schema_oneof_presence`). `$ref`
targets no keyword leads to (`#/definitions/a/b`) are normalized too. A last
pass only splits untyped nodes (`split_typeless`), once anyOf/oneOf siblings
have been pushed down. The input is not mutated.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from formwork.grammar.schema_ifthen import expand_if_then
from formwork.grammar.schema_merge import ANNOTATIONS, merge  # noqa: F401 (merge re-exported)
from formwork.grammar.schema_not import rewrite_not
from formwork.grammar.schema_oneof import inferred_types, pairwise_disjoint
from formwork.grammar.schema_oneof_empty import separate_empty, separate_listed_strings
from formwork.grammar.schema_oneof_presence import presence_one_of
from formwork.grammar.schema_rewrites import (
    complete_array,
    declare_required,
    drop_inapplicable,
    drop_vacuous_unique,
    property_names_as_patterns,
    expand_dependencies,
    filter_enum,
    Forbid,
    forbid_property,
    forbid_property_exactly,
    fold_pattern_lengths,
    split_typeless,
)
from formwork.grammar.schema_walk import (
    is_legacy_draft,
    map_ref_targets,
    resolve_local_ref,
    validator_class,
)

_STAY = ANNOTATIONS | {"$defs", "definitions"}   # never pushed into branches
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_CHILD_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if",
              "then", "else", "unevaluatedProperties", "unevaluatedItems")
_CHILD_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


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
    final: bool = False         # the last pass: only `split_typeless`
    exact_false: bool = False   # the backend enforces `false` subschemas (llguidance)

    @property
    def forbid(self) -> Forbid:
        return forbid_property_exactly if self.exact_false else forbid_property

    def merge(self, a: Any, b: Any) -> dict | None:
        return merge(a, b, self.legacy)


def _rewrite_keywords(node: dict, ctx: _Ctx) -> dict | bool:
    if ctx.final:
        return split_typeless(node, _STAY)
    out = filter_enum(node, ctx.validator)
    if out is not False:
        out = rewrite_not(out, _STAY, ctx.forbid)
    if out is False:
        return False
    out = fold_pattern_lengths(declare_required(complete_array(drop_vacuous_unique(
        property_names_as_patterns(drop_inapplicable(out))))))
    return expand_dependencies(out, ctx.merge, _STAY, ctx.forbid)


def _rewrite(node: dict, ctx: _Ctx) -> dict | bool:
    root, legacy = ctx.root, ctx.legacy
    if not ctx.final and ("if" in node or '"if"' in json.dumps(node.get("allOf", []))):
        split = expand_if_then(node, ctx.merge, lambda b: _resolve(b, root), ctx.validator, _STAY,
                               ctx.forbid)
        node = split if split is not None else node
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
    if isinstance(node.get("oneOf"), list) and not ctx.final:
        branches = [_resolve(b, root) for b in node["oneOf"]]
        separated = separate_empty(branches)
        listed = separate_listed_strings(separated or branches, ctx.validator)
        if listed is not None or separated is not None:
            node = node | {"oneOf": listed or separated}
        if set(node) - _STAY == {"oneOf"} and \
                not pairwise_disjoint(node["oneOf"], root, ctx.validator):
            presence = presence_one_of([_resolve(b, root) for b in node["oneOf"]], _STAY)
            if presence is not None:
                node = {k: v for k, v in node.items() if k in _STAY} | {"anyOf": presence}
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
    if not ctx.exact_false:
        out = _forbid_impossible(out, node)
    for key in _CHILD_ONE:
        if key in out:
            out[key] = _normalize(out[key], ctx, depth + 1)
    for key in _CHILD_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_normalize(v, ctx, depth + 1) for v in out[key]]
    return _rewrite(out, ctx)


def _forbid_impossible(out: dict, node: dict) -> dict:
    """Properties whose schema is `false` (xgrammar refuses it) are forbidden
    instead: always when the object is closed, and when it became `false` here
    (else it gets its original schema back and stays flagged)."""
    props = out.get("properties")
    if not isinstance(props, dict) or False not in props.values():
        return out
    for name in [k for k, v in props.items() if v is False]:
        written = node["properties"].get(name, False) is False
        if written and out.get("additionalProperties") is not False:
            continue                       # forbidding would close an open object
        forbidden = forbid_property(out, name)
        if forbidden is not None:
            out = forbidden
        elif not written:
            out = dict(out, properties=out["properties"] | {name: node["properties"][name]})
    return out


def map_subschemas(schema: Any, fn: Callable[..., Any], with_original: bool = False) -> Any:
    """`schema` with `fn` applied to every subschema object, children first;
    `schema` itself (not a copy) when `fn` changed nothing. `with_original`:
    `fn(node, original)`, `original` the subschema as `schema` holds it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _CHILD_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: map_subschemas(v, fn, with_original) for k, v in out[key].items()}
    for key in _CHILD_ONE:
        if key in out:
            out[key] = map_subschemas(out[key], fn, with_original)
    for key in _CHILD_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [map_subschemas(v, fn, with_original) for v in out[key]]
    out = fn(out, schema) if with_original else fn(out)
    return schema if out == schema else out


def _context(root: dict, final: bool = False, exact_false: bool = False) -> _Ctx:
    cls = validator_class(root)
    return _Ctx(root, is_legacy_draft(root), cls(root), final, exact_false)


def _standard_location(parts: list[str]) -> bool:
    """A pointer the keyword walk reaches (`#/$defs/Name`, `#/properties/a`)."""
    return len(parts) <= 2 and parts[0] in _CHILD_MAPS or all(
        p in _CHILD_ONE for p in parts)


def normalize(schema: Any, exact_false: bool = False) -> Any:
    """An equivalent schema with allOf merged, anyOf/oneOf siblings pushed into
    the branches and the `schema_rewrites` applied where that is exact; `schema`
    itself if nothing changed. `exact_false`: the backend enforces `false`
    subschemas (llguidance), so "property absent" is `properties: {name: false}`
    and never closes an object; else (xgrammar, which refuses `false`) it closes
    objects that are otherwise open."""
    if not isinstance(schema, dict):
        return schema
    out = _normalize(schema, _context(schema, exact_false=exact_false), 0)
    if isinstance(out, dict):              # `$ref` targets where no keyword leads
        ctx = _context(out, exact_false=exact_false)
        out = map_ref_targets(out, lambda node: _normalize(node, ctx, 1), _standard_location)
    if isinstance(out, dict):              # again: `$ref` targets are normalized now
        out = _normalize(out, _context(out, exact_false=exact_false), 0)
    if isinstance(out, dict):
        out = _normalize(out, _context(out, final=True, exact_false=exact_false), 0)
    return schema if json.dumps(out, sort_keys=True) == json.dumps(schema, sort_keys=True) \
        else out
