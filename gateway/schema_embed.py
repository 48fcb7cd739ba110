"""Embedding a JSON Schema inside a larger one so that its `$ref`s keep resolving.

A tool's parameters schema (every pydantic model with a nested model or an enum
has `$defs`) refers to its definitions from its own root (`#/$defs/Item`). Put
under `properties.arguments` of a wrapper, those refs would point at the
wrapper's root: here the definitions move to the wrapper's root under
per-tool names and the refs are rewritten to match. Pure functions on JSON
values; inputs are never mutated.
"""
from __future__ import annotations

import json
import re

_DEFS_KEYWORDS = ("$defs", "definitions")
_ID_KEYWORDS = ("$id", "id")
_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
               "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties",
               "contentSchema")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies",
                "$defs", "definitions")


def defs_prefix(name: str, index: int) -> str:
    """Prefix of a tool's hoisted definition names: its name when that needs no
    escaping in a JSON pointer or URI fragment."""
    return f"{name}." if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f"tool{index}."


def _map_refs(node, rewrite):
    """`node` (a schema) with every `$ref` string replaced by rewrite(ref); walks only
    schema positions, never data (enum, const, default, examples)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("$ref"), str):
        out["$ref"] = rewrite(out["$ref"])
    for kw in _ONE_SCHEMA:
        if isinstance(out.get(kw), dict):
            out[kw] = _map_refs(out[kw], rewrite)
    for kw in _SCHEMA_LISTS:
        if isinstance(out.get(kw), list):
            out[kw] = [_map_refs(s, rewrite) for s in out[kw]]
    for kw in _SCHEMA_MAPS:
        if isinstance(out.get(kw), dict):
            out[kw] = {k: _map_refs(s, rewrite) for k, s in out[kw].items()}
    return out


def embed_schema(schema, at: str, prefix: str, hoisted: dict[str, dict]):
    """`schema`, to be placed at JSON pointer `at` of a larger document: its root
    `$defs`/`definitions` move into `hoisted` (the document root's, names prefixed
    with `prefix`) and its local `$ref`s are rewritten to point where their targets
    now are. A schema without definitions or refs comes back unchanged."""
    if not isinstance(schema, dict) or '"$ref"' not in json.dumps(schema):
        return schema
    moved = {kw: schema[kw] for kw in _DEFS_KEYWORDS if isinstance(schema.get(kw), dict)}
    # The root's own address ($id; `id` before draft-06) goes: left in place it would
    # make the embedded root a document of its own, against which every "#/..." ref
    # inside resolves (SchemaStore's schemas carry one); refs spelled with it are local.
    ids = [kw for kw in _ID_KEYWORDS if isinstance(schema.get(kw), str)
           and (kw == "$id" or re.search(r"draft-0[34]/", str(schema.get("$schema"))))]
    own = {schema[kw].split("#")[0] for kw in ids} - {""}

    def rewrite(ref: str) -> str:
        if own and ref.split("#")[0] in own:
            ref = "#" + ref.partition("#")[2]
        if ref != "#" and not ref.startswith("#/"):
            return ref                    # not local: refused by the schema check as before
        for kw in moved:
            head = f"#/{kw}/"
            if ref.startswith(head):
                return f"{head}{prefix}{ref[len(head):]}"
        return "#" + at + ref[1:]

    out = _map_refs({k: v for k, v in schema.items() if k not in moved and k not in ids}, rewrite)
    for kw, defs in moved.items():
        target = hoisted.setdefault(kw, {})
        for name, definition in defs.items():
            target[prefix + name] = _map_refs(definition, rewrite)
    return out
