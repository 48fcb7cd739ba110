"""Constrained vs free decoding per schema SHAPE, at equal output lengths.

    python bench/structured_shapes.py                    # batch 32, 96 tokens, every shape
    python bench/structured_shapes.py --shapes enum_200 pattern --batch 8

One schema is not a benchmark: length-bounded strings, big enums, patterns and
nesting cost the mask fill and apply differently. Each shape is wrapped as
`{"type": "array", "items": SHAPE, "minItems": 60}` so that no output can end
before --output-len tokens (every constrained output must finish "length":
asserted), and runs next to the same prompts unconstrained with ignore_eos,
alternating, best of --reps each. Reports output tok/s both ways, the ratio,
the engine steps (jump-forward can make the constrained run take fewer), the
bitmask fill ms per step (engine thread, overlapped with the forward; closing
searches included), the share of deferred picks the grammar refused and how many
of those a greedy row's next best tokens answered without a mask, and the apply
ms per step (sampler, on the logits). Two shapes come from
../shared/corpus (a Glaive tool-call argument schema and a Kubernetes object)
when that folder is there.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "corpus" / "jsonschemabench"

SHAPES = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "active": {"type": "boolean"}, "score": {"type": "number"},
        "tier": {"enum": ["gold", "silver", "bronze"]}},
        "required": ["name", "age", "active", "score", "tier"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "zip": {"type": "string", "maxLength": 6}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["id", "tags", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "bounded_string": {"type": "string", "minLength": 5, "maxLength": 40},
    "long_string": {"type": "string", "minLength": 800},
    "enum_200": {"enum": [f"value_{i:03d}_{w}" for i, w in
                          enumerate(["alpha", "beta", "gamma", "delta", "omega"] * 40)]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}-[a-z]{3,6}$"},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1000, "maximum": 1000},
        "n": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["x", "n"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "location": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    # uniqueItems, kept while decoding by grammar/unique_items.py (a matcher wrapper)
    "sets": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1},
                 "uniqueItems": True, "maxItems": 4},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                "uniqueItems": True, "maxItems": 4},
        "level": {"type": "array", "items": {"enum": ["low", "mid", "high"]}, "uniqueItems": True}},
        "required": ["tags", "ids", "level"], "additionalProperties": False},
}
CORPUS_SHAPES = {"corpus_glaive_tool_args": "Glaiveai2K/calculate_area_08f638d4.json",
                 "corpus_kubernetes": "Kubernetes/kb_111_Normalized.json"}


def all_shapes() -> dict[str, dict]:
    shapes = dict(SHAPES)
    for name, rel in CORPUS_SHAPES.items():
        path = CORPUS / rel
        if path.exists():
            shapes[name] = json.loads(path.read_text())
    return shapes


def wrap(shape: dict) -> dict:
    schema = {k: v for k, v in shape.items() if k not in ("$defs", "definitions", "$schema")}
    out = {"type": "array", "items": schema, "minItems": 60}
    for k in ("$defs", "definitions"):      # keep refs resolvable from the new root
        if k in shape:
            out[k] = shape[k]
    return out


def convs(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Produce a JSON array of many records, number {i}."}]
            for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=("auto", "llguidance", "xgrammar", "outlines"))
    ap.add_argument("--no-budget-aware", action="store_true",
                    help="no closing searches in each request's last tokens (--no-budget-aware)")
    ap.add_argument("--eager-masks", action="store_true",
                    help="fill every mask beside the forward (--no-defer-grammar-masks)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from structured_overhead import bench_apply
    from formwork import LLM, SamplingParams, StructuredOutputsParams
    shapes = all_shapes()
    names = args.shapes or list(shapes)
    llm = LLM(dtype="bfloat16", max_num_seqs=max(args.batch, 2), defer_grammar_masks=not args.eager_masks,
              budget_aware=not args.no_budget_aware)
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    apply_ms = bench_apply(llm.engine.vocab_size, [args.batch])[args.batch]
    print(f"batch {args.batch}, {args.output_len} tokens each way, backend {args.backend}, "
          f"{'eager' if args.eager_masks else 'deferred'} masks, budget-aware "
          f"{'off' if args.no_budget_aware else 'on'}; "
          f"bitmask apply on [{args.batch}, vocab] logits: {apply_ms:.3f} ms per step")
    print("| shape | free tok/s | constrained tok/s | constrained ÷ free | steps free / constrained "
          "| fill ms/step | deferred picks refused / rescued without a mask | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for name in names:
        so = StructuredOutputsParams(json=wrap(shapes[name]), backend=args.backend)
        cons = SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=so)
        llm.chat(convs(2), cons, use_tqdm=False)              # compile (cached afterwards)
        best = {"free": (0.0, 0, 0.0), "cons": (0.0, 0, 0.0)}
        g0 = llm.get_stats()
        for _ in range(args.reps):
            for kind, sp in (("free", free), ("cons", cons)):
                s0 = llm.get_stats()
                t0 = time.perf_counter()
                outs = llm.chat(convs(args.batch), sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                s1 = llm.get_stats()
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                assert n == args.batch * args.output_len, f"{name} {kind}: {n} tokens"
                steps = s1.steps - s0.steps
                fill = (s1.bitmask_seconds - s0.bitmask_seconds) / max(steps, 1) * 1e3
                if n / dt > best[kind][0]:
                    best[kind] = (n / dt, steps, fill)
        (f_tps, f_steps, _), (c_tps, c_steps, c_fill) = best["free"], best["cons"]
        ratios.append(c_tps / f_tps)
        g1 = llm.get_stats()
        checks = g1.grammar_deferred_checks - g0.grammar_deferred_checks
        refused = g1.grammar_deferred_refused - g0.grammar_deferred_refused
        rescued = g1.grammar_deferred_rescued - g0.grammar_deferred_rescued
        print(f"| {name} | {f_tps:.1f} | {c_tps:.1f} | {c_tps / f_tps:.3f} | {f_steps} / {c_steps} "
              f"| {c_fill:.2f} | {100 * refused / max(checks, 1):.1f} % / {rescued} of {refused} "
              f"| {os.getloadavg()[0]:.2f} |", flush=True)
    print(f"\nworst shape {min(ratios):.3f}, median {statistics.median(ratios):.3f}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
