"""Budget-aware constrained decoding: valid outputs under a tight max_tokens, off vs on.

    python bench/budget_aware.py                      # 50 requests, max_tokens 24
    python bench/budget_aware.py --num-requests 50 --max-tokens 24 --temperature 0.8
    python bench/budget_aware.py --shapes --max-tokens 24 32 48 64 96    # schema shapes

Each request asks for a JSON object with several string fields (schema below)
and gets too few tokens to write it freely. The same prompts and seeds run with
`structured_outputs.budget_aware` false, then true; the table counts outputs
that parse and validate, their finish reasons, and the wall time of each run.
`--shapes`: the same for every shape of bench/structured_shapes.py that can end
(a ten-field record, a pattern-and-minLength record, two lists of records) at each
--max-tokens: valid outputs off / on per cell.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import jsonschema

from formwork import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                         "genre": {"type": "string"}, "summary": {"type": "string"}},
          "required": ["title", "author", "genre", "summary"], "additionalProperties": False}
TOPICS = ["a detective in Paris", "a robot gardener", "a lost city under the sea",
          "two rival chefs", "a journey to Mars", "a haunted lighthouse", "a talking cat",
          "a time-travelling librarian", "a mountain rescue", "a chess prodigy"]


TEN_FIELDS = {"type": "object", "additionalProperties": False,
              "properties": {f"field_{i}": {"type": "integer"} if i % 3 == 0 else
                             {"type": "string", "maxLength": 30} for i in range(10)},
              "required": [f"field_{i}" for i in range(10)]}
# Strings that cannot close at once: a pattern of counted digits and a minLength (their
# content repeats the same mask while it progresses).
CODED = {"type": "object", "additionalProperties": False,
         "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{5}$"},
                        "summary": {"type": "string", "minLength": 40},
                        "priority": {"enum": ["low", "medium", "high"]}},
         "required": ["id", "summary", "priority"]}
# Lists of records: the model may open another element a few tokens before the end,
# after which the closing path (a whole required element) no longer fits.
RECORDS = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
    "required": ["a", "b"]}}}, "required": ["items"]}
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "kind": {"enum": ["a", "b"]},
                         "addresses": {"type": "array", "items": {
                             "type": "object", "additionalProperties": False,
                             "properties": {"street": {"type": "string"},
                                            "city": {"type": "string"},
                                            "zip": {"anyOf": [{"type": "string"},
                                                              {"type": "null"}]}},
                             "required": ["street", "city", "zip"]}}},
          "required": ["name", "age", "kind", "addresses"]}


def valid(text: str, schema: dict = SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run(llm: LLM, convs: list, args, budget_aware: bool, schema: dict = SCHEMA,
        max_tokens: int | None = None) -> dict:
    params = [SamplingParams(max_tokens=max_tokens or args.max_tokens[0],
                             temperature=args.temperature, seed=i,
                             structured_outputs=StructuredOutputsParams(
                                 json=schema, budget_aware=budget_aware))
              for i in range(len(convs))]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    texts = [o.outputs[0].text for o in outs]
    reasons = collections.Counter(o.outputs[0].finish_reason for o in outs)
    return {"valid": sum(valid(t, schema) for t in texts), "reasons": dict(reasons), "wall_s": wall,
            "example": texts[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[24])
    ap.add_argument("--shapes", action="store_true", help="every shape x every --max-tokens")
    ap.add_argument("--only", nargs="+", default=None, help="with --shapes: these shapes only")
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    llm = LLM(args.model, engine_process=False, max_model_len=1024)
    convs = [[{"role": "user", "content": f"Describe a novel about "
               f"{TOPICS[i % len(TOPICS)]} as JSON with title, author, genre and a long summary."}]
             for i in range(args.num_requests)]
    try:
        if args.shapes:
            return shapes_table(llm, convs, args)
        rows = {"off": run(llm, convs, args, False), "on": run(llm, convs, args, True)}
    finally:
        llm.shutdown()
    print(f"{args.num_requests} requests, max_tokens {args.max_tokens[0]}, "
          f"temperature {args.temperature}")
    print(f"{'budget_aware':>12} {'valid':>7} {'wall s':>7}  finish reasons")
    for name, r in rows.items():
        valid = f"{r['valid']}/{args.num_requests}"
        print(f"{name:>12} {valid:>7} {r['wall_s']:7.1f}  {r['reasons']}")
    for name, r in rows.items():
        print(f"example ({name}): {r['example']!r}")


def shapes_table(llm: LLM, convs: list, args) -> None:
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_shapes import SHAPES
    shapes = {k: v for k, v in SHAPES.items() if k != "long_string"} | \
        {"ten_fields": TEN_FIELDS, "coded": CODED, "records": RECORDS, "person": PERSON}
    shapes = {k: v for k, v in shapes.items() if not args.only or k in args.only}
    print(f"{args.num_requests} requests per cell, temperature {args.temperature}; "
          "valid outputs with budget_aware off / on")
    print("| shape | " + " | ".join(f"max_tokens {m}" for m in args.max_tokens) + " |")
    print("|---|" + "---|" * len(args.max_tokens))
    total = {"off": 0, "on": 0}
    for name, schema in shapes.items():
        cells = []
        for m in args.max_tokens:
            got = {k: run(llm, convs, args, k == "on", schema, m)["valid"] for k in ("off", "on")}
            total["off"] += got["off"]
            total["on"] += got["on"]
            cells.append(f"{got['off']} / {got['on']}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"all cells: {total['off']} / {total['on']} of "
          f"{args.num_requests * len(shapes) * len(args.max_tokens)}; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
