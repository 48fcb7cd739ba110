"""Budget-aware constrained decoding: valid outputs under a tight max_tokens, off vs on.

    python bench/budget_aware.py                      # 50 requests, max_tokens 24
    python bench/budget_aware.py --num-requests 50 --max-tokens 24 --temperature 0.8

Each request asks for a JSON object with several string fields (schema below)
and gets too few tokens to write it freely. The same prompts and seeds run with
`structured_outputs.budget_aware` false, then true; the table counts outputs
that parse and validate, their finish reasons, and the wall time of each run.
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


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run(llm: LLM, convs: list, args, budget_aware: bool) -> dict:
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                             structured_outputs=StructuredOutputsParams(
                                 json=SCHEMA, budget_aware=budget_aware))
              for i in range(len(convs))]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    texts = [o.outputs[0].text for o in outs]
    reasons = collections.Counter(o.outputs[0].finish_reason for o in outs)
    return {"valid": sum(valid(t) for t in texts), "reasons": dict(reasons), "wall_s": wall,
            "example": texts[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    llm = LLM(args.model, engine_process=False, max_model_len=1024)
    convs = [[{"role": "user", "content": f"Describe a novel about "
               f"{TOPICS[i % len(TOPICS)]} as JSON with title, author, genre and a long summary."}]
             for i in range(args.num_requests)]
    try:
        rows = {"off": run(llm, convs, args, False), "on": run(llm, convs, args, True)}
    finally:
        llm.shutdown()
    print(f"{args.num_requests} requests, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}")
    print(f"{'budget_aware':>12} {'valid':>7} {'wall s':>7}  finish reasons")
    for name, r in rows.items():
        valid = f"{r['valid']}/{args.num_requests}"
        print(f"{name:>12} {valid:>7} {r['wall_s']:7.1f}  {r['reasons']}")
    for name, r in rows.items():
        print(f"example ({name}): {r['example']!r}")


if __name__ == "__main__":
    main()
