"""Random adversarial JSON schemas: a soundness fuzz on schemas nobody wrote.

Each seed makes one schema from a mix of the keywords where backends have been
loose (long floats and big integers in enums and bounds, patterns beside formats
and lengths, prefixItems with item counts, special-token text in keys and
values, composition, local and recursive `$ref`s, draft-4 exclusive bounds,
dependentRequired, ...). Every schema a backend accepts gets random walks under
its mask (bench/schema_coverage.py's walker: SmolLM2's tokenizer, closing tokens
favoured); every finished output must parse and validate against the original
schema with jsonschema, formats checked. Reported: accepted, rejections by
keyword, invalid walk outputs (each printed with its seed and schema), walks that
met a special token or a failed matcher.

  python bench/schema_fuzz.py [--start 0] [--count 1000] [--backend auto]
      [--walks 4] [--additional-properties declared|schema] [--print SEED]
  python bench/schema_fuzz.py --engine [--start 0] [--count 300] [--max-tokens 48]

`--engine` runs the schemas `auto` serves through `LLM.generate` instead (the whole
decoding path: jump-forward, deferred masks, budget-aware closing), greedy and at
temperature 1, and validates every output that parses.

Found on its first runs (2026-12-07), each fixed with a regression test in
tests/test_grammar_soundness.py: enum numbers llguidance and outlines-core wrote
as other numbers, integer bounds past 2^53, a key spelling `<|im_end|>` that
failed its request, three keywords outlines-core dropped.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import string
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

FORMATS = ("date", "date-time", "time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname",
           "duration", "uri-reference", "json-pointer", "regex", "idn-email", "iri")
# patterns both Python's `re` (jsonschema's ground truth) and the backends read
PATTERNS = (r"^[a-z]{2,4}$", r"^\d+$", r"[A-Z]", r"^(foo|bar)baz?$", r"^\w+@\w+\.com$",
            r"^.{3}$", r"ab+c", r"^[^\s]*$", r"^[\u00e0-\u00ff]+$", r"^(?!x).*$", r"^a*$",
            r"\d{3}-\d{2}", r"^$", r"^[0-9a-f]{8}(-[0-9a-f]{4}){3}$", r"^\S+$", r"^[.]+$",
            r'^"+$', r"^\\\\$", r"^[\x00-\x7f]*$", r"x|^y$", r"^(a|b)*c$", r"^.*[^a]$")
TEXTS = ("", " ", 'a"b', "back\\slash", "tab\there", "new\nline", "ünï", "😀", "\u2028",
         "null", "0", "-", "a/b", "\x7f", "<|im_end|>", "</tool_call>")
KINDS = ("string", "integer", "number", "boolean", "null", "enum", "const", "array", "object",
         "anyOf", "oneOf", "allOf", "typelist", "empty", "not", "ifthen", "ref", "bool",
         "recursive", "string-enum", "draft4-bounds", "dependencies")
LEAF_KINDS = KINDS[:7]


def _text(r: random.Random) -> str:
    if r.random() < 0.5:
        return r.choice(TEXTS)
    return "".join(r.choice(string.ascii_letters) for _ in range(r.randint(1, 8)))


def _value(r: random.Random):
    return r.choice([_text(r), r.randint(-3, 3), r.random(), None, True, [1, "a"],
                     {"k": r.random()}, 1.0, -0.0, 1e20, 2 ** 53 + r.randint(1, 99), 1e23,
                     r.uniform(-1e6, 1e6), 1.5])


def _number(r: random.Random, kind: str) -> dict:
    s: dict = {"type": kind}
    if r.random() < 0.4:
        s["minimum"] = r.choice([0, -5, 1.5, -0.5, 10, 2 ** 53, -(2 ** 63), 1e-3, r.random(),
                                 2 ** 53 + 3, 1e23])
    if r.random() < 0.4:
        s["maximum"] = s.get("minimum", 0) + r.choice([0, 1, 7.25, 100, 0.5, r.random(), 2])
    draft4 = getattr(r, "draft4", False)
    if r.random() < 0.2:
        s["exclusiveMinimum"] = r.choice([True, False]) if draft4 else r.choice([0, 1, -1.5])
    if r.random() < 0.2:
        s["exclusiveMaximum"] = r.choice([True, False]) if draft4 else r.choice([10, 2.5, 100])
    if r.random() < 0.3:
        s["multipleOf"] = r.choice([2, 3, 0.5, 0.1, 0.01, 7, 1e-5, 2.5])
    return s


def _object(r: random.Random, depth: int, defs: dict | None) -> dict:
    s: dict = {"type": "object"}
    props = {r.choice([_text(r), "id", "name", "type", "$ref", "properties"]): _node(r, depth + 1, defs)
             for _ in range(r.randint(0, 4))}
    if props:
        s["properties"] = props
        if r.random() < 0.6:
            s["required"] = r.sample(sorted(props), r.randint(0, len(props)))
            if not s["required"] and getattr(r, "draft4", False):
                del s["required"]             # draft 4: never empty
    x = r.random()
    if x < 0.3:
        s["additionalProperties"] = False
    elif x < 0.45:
        s["additionalProperties"] = _node(r, depth + 1, defs)
    if r.random() < 0.1:
        s["patternProperties"] = {r.choice(["^x_", "^[0-9]+$"]): _node(r, depth + 1, defs)}
    if r.random() < 0.1:
        s["minProperties"] = r.randint(0, 2)
    if r.random() < 0.1:
        s["maxProperties"] = r.randint(1, 3)
    if r.random() < 0.1:
        s["propertyNames"] = {"pattern": "^[a-z]+$"}
    if props and r.random() < 0.1:
        s["dependentRequired"] = {r.choice(sorted(props)): [r.choice(sorted(props))]}
    return s


def _array(r: random.Random, depth: int, defs: dict | None) -> dict:
    s: dict = {"type": "array"}
    if r.random() < 0.3:
        s["prefixItems"] = [_node(r, depth + 1, defs) for _ in range(r.randint(1, 3))]
        if r.random() < 0.5:
            s["items"] = r.choice([{} if getattr(r, "draft4", False) else False,
                                   _node(r, depth + 1, defs)])
    elif r.random() < 0.8:
        s["items"] = _node(r, depth + 1, defs)
    if r.random() < 0.4:
        s["minItems"] = r.randint(0, 3)
    if r.random() < 0.4:
        s["maxItems"] = s.get("minItems", 0) + r.randint(0, 3)
    if r.random() < 0.15:
        s["uniqueItems"] = True
    if r.random() < 0.1:
        s["contains"] = _node(r, depth + 1, defs)
    return s


def _node(r: random.Random, depth: int = 0, defs: dict | None = None):
    kind = r.choice(LEAF_KINDS if depth >= 3 else KINDS)
    s: dict = {}
    if kind == "string":
        s["type"] = "string"
        if r.random() < 0.4:
            s["minLength"] = r.randint(0, 5)
        if r.random() < 0.4:
            s["maxLength"] = s.get("minLength", 0) + r.randint(0, 6)
        if r.random() < 0.3:
            s["pattern"] = r.choice(PATTERNS)
        if r.random() < 0.2:
            s["format"] = r.choice(FORMATS)
    elif kind in ("integer", "number"):
        s = _number(r, kind)
    elif kind in ("boolean", "null"):
        s["type"] = kind
    elif kind == "enum":
        values: list = []
        for v in (_value(r) for _ in range(r.randint(1, 5))):
            if not any(type(v) is type(o) and v == o for o in values):   # unique, as the meta-schema asks
                values.append(v)
        s["enum"] = values
        if r.random() < 0.3:
            s["type"] = r.choice(["string", "integer", "number"])
    elif kind == "const":
        s["const"] = r.choice([_text(r), 3, 2.5, None, False, {"a": [1, 2]}, [], 0])
    elif kind == "array":
        s = _array(r, depth, defs)
    elif kind == "object":
        s = _object(r, depth, defs)
    elif kind in ("anyOf", "oneOf", "allOf"):
        s[kind] = [_node(r, depth + 1, defs) for _ in range(r.randint(1, 3))]
        if r.random() < 0.3:
            s["type"] = r.choice(["object", "string", "integer"])
    elif kind == "typelist":
        s["type"] = r.sample(["string", "integer", "number", "boolean", "null", "array", "object"],
                             r.randint(1, 3))
        if "string" in s["type"] and r.random() < 0.5:
            s["maxLength"] = r.randint(0, 4)
        if "integer" in s["type"] and r.random() < 0.5:
            s["minimum"] = r.randint(-2, 2)
    elif kind == "not":
        s = {"type": r.choice(["string", "integer"]), "not": _node(r, depth + 1, defs)}
    elif kind == "ifthen":
        s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
             "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]},
             "else": {"required": ["a"]}}
    elif kind == "ref" and defs is not None:
        name = f"d{len(defs)}"
        defs[name] = {}
        defs[name] = _node(r, depth + 1, defs)
        s = {"$ref": f"#/$defs/{name}"}
        if r.random() < 0.2:
            s["description"] = "a sibling annotation"
        if r.random() < 0.1:
            s["type"] = "string"
    elif kind == "recursive" and defs is not None:
        name = f"r{len(defs)}"
        defs[name] = {"type": "object", "properties": {
            "v": _node(r, depth + 1, None),
            "next": {"anyOf": [{"$ref": f"#/$defs/{name}"}, {"type": "null"}]}},
            "required": r.choice([["v"], ["v", "next"], []])}
        s = {"$ref": f"#/$defs/{name}"}
    elif kind == "string-enum":
        s = {"type": "string", "enum": list(dict.fromkeys(_text(r) for _ in range(r.randint(1, 6))))}
    elif kind == "draft4-bounds":    # boolean exclusive flags: a draft-4 root's only
        draft4 = getattr(r, "draft4", False)
        s = {"type": r.choice(["number", "integer"]), "minimum": r.choice([0, 1.5, -3]),
             "exclusiveMinimum": True if draft4 else r.choice([-1, 0.5]),
             "maximum": r.choice([10, 2.5]),
             "exclusiveMaximum": r.choice([True, False]) if draft4 else r.choice([9, 2.25])}
    elif kind == "dependencies":
        s = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
             "dependentRequired": {"a": ["b"]},
             "additionalProperties": r.choice([True, False, {"type": "boolean"}])}
    elif kind == "bool":             # boolean schemas: draft 6 on
        return {} if getattr(r, "draft4", False) else r.choice([True, False, {}])
    if r.random() < 0.1:
        s["default"] = None
    if r.random() < 0.1:
        s["nullable"] = True          # OpenAPI's; annotates only in JSON Schema
    return s


def random_schema(seed: int):
    """The schema of one seed (the same on every machine and Python 3.11+)."""
    r = random.Random(seed)
    r.draft4 = r.random() < 0.15       # read by the draft4-bounds kind
    defs: dict = {}
    root = _node(r, 0, defs)
    if r.random() < 0.7:
        root = {"type": "object", "properties": {"x": root, "y": _node(r, 1, defs)}, "required": ["x"]}
    if defs and isinstance(root, dict):
        root["$defs"] = defs
    if r.draft4 and isinstance(root, dict):
        root["$schema"] = "http://json-schema.org/draft-04/schema#"
    return root


def run(runner, seeds, verbose: bool = True) -> dict:
    """Fuzz `seeds` with a schema_coverage.Runner; the tallies, and the seeds whose
    walks ended invalid (or met a special token or a failed matcher)."""
    import schema_coverage as sc

    out = {"accepted": 0, "rejected": collections.Counter(), "walks": 0, "bad": [],
           "special": [], "matcher_errors": []}
    for seed in seeds:
        schema = random_schema(seed)
        try:
            res = runner.run(sc.Case("fuzz", str(seed), schema, []))
        except AssertionError as e:     # the mask allowed a token its matcher refused
            out["bad"].append((seed, "?", [str(e)]))
            if verbose:
                print(f"bad seed {seed}: {e} {json.dumps(schema)[:400]}", flush=True)
            continue
        if not res.accepted:
            out["rejected"][res.reason] += 1
            continue
        out["accepted"] += 1
        out["walks"] += res.walks_finished
        for key, found in (("bad", res.walk_invalid), ("special", res.walk_special),
                           ("matcher_errors", res.walk_errors)):
            if found:
                out[key].append((seed, res.backend, found if isinstance(found, list) else []))
                if verbose:
                    print(f"{key} seed {seed} ({res.backend}): {found} {json.dumps(schema)[:400]}",
                          flush=True)
    return out


def run_engine(seeds, max_tokens: int) -> dict:
    """The schemas `auto` serves through the engine (`LLM.generate`: jump-forward,
    deferred masks, budget-aware closing), each greedy and at temperature 1; every
    output that parses is validated (formats checked). Tallies by finish reason;
    the invalid ones printed."""
    import jsonschema

    from formwork import LLM, SamplingParams, StructuredOutputsParams
    from formwork.grammar.selection import choose_backend

    llm = LLM("SmolLM2-135M-Instruct", max_model_len=2048)
    prompts, params, served = [], [], []
    for seed in seeds:
        schema = random_schema(seed)
        try:
            choose_backend(StructuredOutputsParams(json=schema))
        except ValueError:                  # refused (UnsupportedSchemaError) or invalid
            continue
        for temperature in (0.0, 1.0):
            prompts.append(f"Write JSON for this schema: {json.dumps(schema)[:300]}")
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            served.append((seed, schema))
    tally: collections.Counter = collections.Counter()
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for (seed, schema), out in zip(served, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        tally[c.finish_reason] += 1
        try:
            value = json.loads(c.text)
        except ValueError:
            tally["not JSON, " + c.finish_reason] += 1
            print(f"not JSON, seed {seed} ({c.finish_reason}): {c.text[:200]!r}", flush=True)
            continue
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        errors = list(cls(schema, format_checker=checker).iter_errors(value))
        tally[("invalid, " if errors else "valid, ") + c.finish_reason] += 1
        if errors:
            print(f"invalid, seed {seed} ({c.finish_reason}): {errors[0].validator}: "
                  f"{c.text[:160]!r} {json.dumps(schema)[:300]}", flush=True)
    return {"schemas": len(served) // 2, "requests": len(served), "tally": dict(tally)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--backend", default="auto", choices=("auto", "llguidance", "xgrammar", "outlines"))
    ap.add_argument("--walks", type=int, default=4)
    ap.add_argument("--walk-tokens", type=int, default=200)
    ap.add_argument("--additional-properties", default="declared", choices=("declared", "schema"))
    ap.add_argument("--print", type=int, default=None, metavar="SEED", help="print one seed's schema")
    ap.add_argument("--engine", action="store_true",
                    help="run the schemas auto serves through LLM.generate instead of walks")
    ap.add_argument("--max-tokens", type=int, default=48, help="with --engine")
    args = ap.parse_args(argv)
    if args.print is not None:
        print(json.dumps(random_schema(args.print), indent=1))
        return 0
    if args.engine:
        out = run_engine(range(args.start, args.start + args.count), args.max_tokens)
        print(f"{out['schemas']} schemas served of seeds {args.start}..{args.start + args.count - 1}, "
              f"{out['requests']} requests (max_tokens {args.max_tokens}): {out['tally']}")
        return 1 if any(k.startswith("invalid, stop") or k == "not JSON, stop" for k in out["tally"]) else 0
    import schema_coverage as sc
    from formwork.gpu.model_files import load_model_tokenizer

    tok = load_model_tokenizer(None)
    runner = sc.Runner(tok, len(tok), args.backend, walks=args.walks, walk_tokens=args.walk_tokens,
                       additional_properties=args.additional_properties)
    t0 = time.perf_counter()
    out = run(runner, range(args.start, args.start + args.count))
    print(f"{args.count} schemas (seeds {args.start}..{args.start + args.count - 1}), backend "
          f"{args.backend}, {time.perf_counter() - t0:.0f} s: accepted {out['accepted']}, "
          f"finished walks {out['walks']}, invalid walk outputs in {len(out['bad'])} schemas, "
          f"special tokens in {len(out['special'])}, failed matchers in "
          f"{len(out['matcher_errors'])}; rejected by keyword: "
          f"{dict(out['rejected'].most_common(12))}")
    return 1 if out["bad"] or out["special"] else 0


if __name__ == "__main__":
    sys.exit(main())
