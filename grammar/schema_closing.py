"""The object language a JSON schema is generated with, before a backend compiles it:

- `drop_legacy_ref_siblings`: in drafts 3-7 a node with `$ref` means its target
  only (its other keywords are ignored: jsonschema's `ignore_ref_siblings`);
  llguidance intersects them. The siblings are dropped: exact for those drafts.
- `close_declared_objects` (additional_properties="declared", the default): an
  object node that lists properties and says nothing about others generates only
  the declared ones. Where a node is intersected with other subschemas (its
  `$ref`, `allOf`, `anyOf`/`oneOf` branches, `then`/`else`, dependent schemas),
  closing each part to its own names would refuse the names the other parts
  declare (a node with `properties` beside `anyOf: [{"$ref": ...}]` admitted
  only `{}`); such a node is closed to the union of the names its parts declare
  and the parts are left open. `properties: {}` declares nothing: left open.
Inputs are not mutated.
"""
from __future__ import annotations

from typing import Any

from formwork.grammar.schema_normalize import map_subschemas
from formwork.grammar.schema_walk import is_legacy_draft, iter_nodes, local_refs, resolve_local_ref

_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords of a `$ref` node that drafts 3-7 keep: where other `$ref`s point, and notes.
_REF_KEEPS = frozenset({"$ref", "definitions", "$defs", "$schema", "$id", "id", "title",
                        "description", "$comment"})
# Subschemas a node's instance must also satisfy (its "parts"), keyword by keyword.
_PART_LISTS = ("allOf", "anyOf", "oneOf")
_PART_ONE = ("then", "else")
_PART_MAPS = ("dependentSchemas", "dependencies")


def drop_legacy_ref_siblings(schema: Any) -> Any:
    """Drafts 3-7: every `$ref` node reduced to its `$ref` (and what other refs may
    point into); `schema` unchanged for later drafts, or when a local `$ref` would
    no longer resolve."""
    if not isinstance(schema, dict) or not is_legacy_draft(schema):
        return schema

    def strip(node: dict) -> dict:
        if isinstance(node.get("$ref"), str):
            return {k: v for k, v in node.items() if k in _REF_KEEPS}
        return node

    out = map_subschemas(schema, strip)
    out = strip(out) if isinstance(out, dict) else out
    if out is not schema and any(resolve_local_ref(out, r) is None
                                 for r in local_refs(schema) if resolve_local_ref(schema, r)):
        return schema
    return out


def close_declared(node: dict, extra_names: frozenset[str] = frozenset()) -> dict:
    """Not exact but stricter: an object node that lists `properties` (and, for an
    intersected node, `extra_names` its parts declare) and says nothing about other
    properties admits only those. Left open when a required name is undeclared
    (closing would make it unsatisfiable) or when nothing is declared."""
    props = node.get("properties")
    if props is None and extra_names and isinstance(node.get("required"), list):
        props = {}                   # an intersected node that only requires names
    if not isinstance(props, dict) or any(k in node for k in _OPENERS):
        return node
    names = _allowed_names(props) | extra_names
    if not names:                    # nothing declared, or only forbidden names
        return node
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if any(name not in names for name in required):
        return node
    added = {n: {} for n in sorted(extra_names - props.keys())}
    return node | {"properties": props | added if added else props,
                   "additionalProperties": False}


def _allowed_names(props: dict) -> set[str]:
    """The names `properties` declares, less those it forbids (`name: false`, as
    "property absent" is written for llguidance): an object whose only declared
    names are forbidden ones declares nothing, and closing it would admit only {}."""
    return {name for name, sub in props.items() if sub is not False}


def _parts(node: dict, root: dict) -> list[Any]:
    out: list[Any] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_local_ref(root, ref)
        out += [target[0]] if target else []
    for key in _PART_LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    out += [node[k] for k in _PART_ONE if k in node]
    for key in _PART_MAPS:
        if isinstance(node.get(key), dict):
            out += [v for v in node[key].values() if isinstance(v, dict)]
    return [p for p in out if isinstance(p, dict)]


def _intersected(node: dict) -> bool:
    """Does `node` constrain object properties beside parts that may declare others?"""
    own = bool(node.get("properties")) or bool(node.get("required")) \
        or any(k in node for k in _OPENERS)
    all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    return own or len(all_of) >= 2


def _group(node: dict, root: dict) -> list[dict]:
    """`node`'s parts, transitively (each once, cycles cut)."""
    seen, stack, out = {id(node)}, _parts(node, root), []
    while stack:
        part = stack.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        out.append(part)
        stack += _parts(part, root)
    return out


def close_declared_objects(schema: Any) -> Any:
    """`schema` with its object nodes closed to their declared properties (module
    doc): intersected nodes to the union of their parts' names, their parts left
    open; the others each to their own."""
    if not isinstance(schema, dict):
        return schema
    extra: dict[int, frozenset[str] | None] = {}    # intersected node -> names (None: stays open)
    parts: set[int] = set()
    for sn in iter_nodes(schema):    # every reachable subschema, `$ref` targets included
        node = sn.schema
        group = _group(node, schema)
        if group and _intersected(node):
            parts.update(id(p) for p in group)
            names: set[str] | None = set()
            for p in group:
                if any(k in p and p[k] is not False for k in _OPENERS):
                    names = None        # a part admits undeclared names: the node stays open
                    break
                if isinstance(p.get("properties"), dict):
                    names |= _allowed_names(p["properties"])
                if isinstance(p.get("required"), list):     # a part may require a name
                    names |= {n for n in p["required"] if isinstance(n, str)}   # it never declares
            extra[id(node)] = None if names is None else frozenset(names)

    def close(new: dict, original: dict) -> dict:
        key = id(original)
        if key in parts:
            return new
        if key in extra:
            return new if extra[key] is None else close_declared(new, extra[key])
        return close_declared(new)

    return map_subschemas(schema, close, with_original=True)
