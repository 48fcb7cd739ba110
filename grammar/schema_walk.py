"""Walk the subschemas of a JSON Schema that can constrain an instance.

Only subschemas reachable from the root are visited: definitions nobody
references cannot constrain anything. A local `$ref` target is visited once,
at its own path. Paths are JSONPath-like: `$.properties.tags`, `$.anyOf[1]`,
`$.properties['a b']`.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import jsonschema

SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
SCHEMA_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames",
              "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_IDENT = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")
LEGACY_DRAFTS = (jsonschema.Draft3Validator, jsonschema.Draft4Validator,
                 jsonschema.Draft6Validator, jsonschema.Draft7Validator)


def child_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENT.match(key):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def validator_class(root: Any) -> type:
    """The jsonschema validator class for the draft `root` declares (default 2020-12)."""
    return jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)


def is_legacy_draft(root: Any) -> bool:
    """Drafts 3-7: `$ref` siblings are ignored and `items` may be a tuple."""
    return validator_class(root) in LEGACY_DRAFTS


def resolve_local_ref(root: Any, ref: str) -> tuple[Any, str] | None:
    """Resolve `#` or `#/json/pointer` inside `root`: (target, path) or None."""
    if ref == "#":
        return root, "$"
    if not ref.startswith("#/"):
        return None
    node, path = root, "$"
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node, path = node[part], child_path(path, part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, path = node[int(part)], child_path(path, int(part))
        else:
            return None
    return node, path


@dataclass(frozen=True, slots=True)
class SchemaNode:
    schema: dict
    path: str


def iter_nodes(root: Any) -> Iterator[SchemaNode]:
    """Pre-order walk over reachable object subschemas (boolean schemas skipped).
    In drafts 3-7 a node with `$ref` stands for its target only."""
    legacy = is_legacy_draft(root)
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "$")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield SchemaNode(node, path)
        children: list[tuple[Any, str]] = []
        if legacy and "$ref" in node:
            node = {"$ref": node["$ref"]}
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                p = child_path(path, key)
                children += [(v, child_path(p, k)) for k, v in node[key].items()]
        deps = node.get("dependencies")
        if isinstance(deps, dict):
            p = child_path(path, "dependencies")
            children += [(v, child_path(p, k)) for k, v in deps.items() if isinstance(v, dict)]
        for key in SCHEMA_ONE:
            if key in node:
                children.append((node[key], child_path(path, key)))
        items = node.get("items")
        if isinstance(items, list):
            children += [(v, child_path(child_path(path, "items"), i)) for i, v in enumerate(items)]
        elif items is not None:
            children.append((items, child_path(path, "items")))
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                p = child_path(path, key)
                children += [(v, child_path(p, i)) for i, v in enumerate(node[key])]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve_local_ref(root, ref)
            if target is not None:
                children.append(target)
        stack.extend(reversed(children))


_DATA = frozenset({"enum", "const", "default", "examples"})   # values, never schemas


def _pointer(ref: str) -> list[str] | None:
    if not ref.startswith("#/"):
        return None
    return [unquote(raw).replace("~1", "/").replace("~0", "~") for raw in ref[2:].split("/")]


def local_refs(node: Any) -> set[str]:
    """Every local `$ref` string in the document (data values skipped)."""
    out: set[str] = set()
    if isinstance(node, list):
        for v in node:
            out |= local_refs(v)
    elif isinstance(node, dict):
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
            out.add(node["$ref"])
        for k, v in node.items():
            if k not in _DATA:
                out |= local_refs(v)
    return out


def map_ref_targets(root: dict, fn, skip) -> dict:
    """`root` with `fn` applied to the target of every local `$ref` whose JSON
    pointer `skip(parts)` does not exclude (a copy along the way; `root` itself
    is not mutated)."""
    for ref in sorted(local_refs(root)):
        parts = _pointer(ref)
        if parts is None or skip(parts) or resolve_local_ref(root, ref) is None:
            continue
        root = _replace_at(root, parts, fn)
    return root


def _replace_at(node: Any, parts: list[str], fn) -> Any:
    if not parts:
        return fn(node) if isinstance(node, dict) else node
    head, rest = parts[0], parts[1:]
    if isinstance(node, dict):
        return node | {head: _replace_at(node[head], rest, fn)}
    out = list(node)
    out[int(head)] = _replace_at(out[int(head)], rest, fn)
    return out
