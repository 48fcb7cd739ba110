"""Cost of constrained decoding: the same requests unconstrained vs
json_schema-constrained at batch 1, 8 and 32, at EQUAL output lengths.

The constrained requests carry a schema whose string field has a minLength
far beyond max_tokens, so both variants generate exactly --output-len tokens
(finish "length"); early-stopping constrained requests cannot fake the ratio.
Both run in one process on one engine, alternating, so noise hits both.
Also reports per-step bitmask fill time (engine thread, overlapped with the
forward), the apply time on the logits, and the jump-forward saving on a
key-heavy schema.

    python bench/structured_overhead.py                  # batch 1, 8, 32
    python bench/structured_overhead.py --batches 32 --output-len 96
    python bench/structured_overhead.py --device cuda --load-format dummy --model DIR \
        --batches 32 128 --timeline --skip-jump-forward    # bench/gpu_check.sh

--timeline runs the engine in this process and prints, per batch, each step's
phases on the engine's clocks: forward submitted, grammar fill start/end, the
forward's return on its thread (on CUDA: its kernels queued, not finished),
the sampled tokens back (GPU work done); constrained next to unconstrained.
"""
from __future__ import annotations

import argparse
import statistics
import time


LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
    "required": ["story"], "additionalProperties": False,
}
KEY_HEAVY_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 20},
        "shipping_address_line": {"type": "string", "maxLength": 20},
        "order_status": {"enum": ["pending", "shipped", "delivered"]},
        "is_priority_customer": {"type": "boolean"},
        "number_of_items_ordered": {"type": "integer", "minimum": 0, "maximum": 99},
        "preferred_contact_method": {"enum": ["email", "phone"]},
    },
    "required": ["customer_full_name", "shipping_address_line", "order_status",
                 "is_priority_customer", "number_of_items_ordered", "preferred_contact_method"],
    "additionalProperties": False,
}


def prompts(n: int) -> list[list[dict]]:
    topics = ["a lighthouse", "a robot", "the ocean", "a mountain", "a city", "a forest", "a dragon", "a train"]
    return [[{"role": "user", "content": f"Write a JSON object with a long story about {topics[i % len(topics)]}."}]
            for i in range(n)]


def timed_chat(llm, convs, sp):
    t0 = time.perf_counter()
    outs = llm.chat(convs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), outs


class Timeline:
    """StepHooks.on_timing collector: one row per step while `label` is set."""

    def __init__(self):
        self.label, self.rows = None, {}

    def __call__(self, t: dict[str, float]) -> None:
        if self.label is not None:
            self.rows.setdefault(self.label, []).append({**t, "sampled": time.perf_counter()})

    def report(self, b: int) -> str:
        def med(rows, a, z):
            return statistics.median((r[z] - r[a]) * 1e3 for r in rows)
        plain, con = self.rows.get(("plain", b), []), self.rows.get(("constrained", b), [])
        if not plain or not con:
            return f"timeline b={b}: no steps recorded"
        hidden = sum(r["fill_end"] <= r["forward_end"] for r in con) / len(con)
        lines = [f"timeline b={b} (median ms after submit; {len(con)} constrained steps): "
                 f"fill {med(con, 'submitted', 'fill_start'):.2f}-{med(con, 'submitted', 'fill_end'):.2f}, "
                 f"forward returned {med(con, 'submitted', 'forward_end'):.2f}, "
                 f"sampled {med(con, 'submitted', 'sampled'):.2f} "
                 f"(unconstrained: returned {med(plain, 'submitted', 'forward_end'):.2f}, "
                 f"sampled {med(plain, 'submitted', 'sampled'):.2f}); "
                 f"fill ended before the forward returned in {hidden:.0%} of steps"]
        for r in con[len(con) // 2:len(con) // 2 + 3]:
            s = r["submitted"]
            lines.append(f"  step: submit 0 | fill {1e3 * (r['fill_start'] - s):.2f}-{1e3 * (r['fill_end'] - s):.2f}"
                         f" | forward returned {1e3 * (r['forward_end'] - s):.2f}"
                         f" | sampled {1e3 * (r['sampled'] - s):.2f}")
        return "\n".join(lines)


def bench_apply(vocab: int, batches, reps: int = 50):
    import torch
    from formwork.kernels.bitmask import apply_bitmask
    rows = {}
    for b in batches:
        logits = torch.randn(b, vocab)
        mask = torch.randint(-2**31, 2**31 - 1, (b, (vocab + 31) // 32), dtype=torch.int32)
        ts = []
        for _ in range(reps):
            x = logits.clone()
            t0 = time.perf_counter()
            apply_bitmask(x, mask)
            ts.append(time.perf_counter() - t0)
        rows[b] = statistics.median(ts) * 1e3
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--eager-masks", action="store_true",
                    help="fill every mask beside the forward (--no-defer-grammar-masks)")
    ap.add_argument("--no-budget-aware", action="store_true", help="no closing searches (--no-budget-aware)")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: random weights from config.json alone (bench/gpu/random_model.py)")
    ap.add_argument("--timeline", action="store_true",
                    help="engine in this process; print each batch's step phases")
    ap.add_argument("--skip-jump-forward", action="store_true", help="no jump-forward comparison")
    ap.add_argument("--backend", default="auto",
                    choices=("auto", "llguidance", "xgrammar", "outlines"))
    args = ap.parse_args(argv)
    from formwork import LLM, SamplingParams, StructuredOutputsParams
    timeline, extra = Timeline(), {}    # records only when the engine calls it (--timeline)
    if args.timeline:
        from formwork.core.step_hooks import StepHooks
        extra = {"engine_process": False, "step_hooks": StepHooks(on_timing=timeline)}
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batches),
              defer_grammar_masks=not args.eager_masks, budget_aware=not args.no_budget_aware,
              load_format=args.load_format, **extra)
    so = StructuredOutputsParams(json=LONG_STRING_SCHEMA, backend=args.backend)
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=so)
    llm.chat(prompts(2), constrained, use_tqdm=False)            # warm-up + compile cache
    print(f"| batch | unconstrained tok/s | constrained tok/s | ratio | fill ms/step | steps |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        convs = prompts(b)
        tp, tc = [], []
        for _ in range(args.reps):
            timeline.label = ("plain", b)
            dt, n, _ = timed_chat(llm, convs, plain)
            tp.append(n / dt)
            s0 = llm.get_stats()
            timeline.label = ("constrained", b)
            dt, n2, outs = timed_chat(llm, convs, constrained)
            s1 = llm.get_stats()
            timeline.label = None
            assert n2 == n, f"constrained produced {n2} tokens, unconstrained {n}: not comparable"
            assert all(o.outputs[0].finish_reason == "length" for o in outs)
            tc.append(n2 / dt)
        steps = s1.steps - s0.steps
        fill_ms = (s1.bitmask_seconds - s0.bitmask_seconds) / max(steps, 1) * 1e3
        up, uc = statistics.median(tp), statistics.median(tc)
        print(f"| {b} | {up:.1f} | {uc:.1f} | {uc / up:.3f} | {fill_ms:.3f} | {steps} |")
    if args.timeline:
        print("\n" + "\n".join(timeline.report(b) for b in args.batches))
    apply = bench_apply(llm.engine.vocab_size, args.batches)
    print("\nbitmask apply on [batch, vocab] float32 logits (median ms): " +
          ", ".join(f"b={b}: {ms:.3f}" for b, ms in apply.items()))
    if args.skip_jump_forward:
        llm.shutdown()
        return
    # jump-forward: key-heavy schema, on vs off (a second engine with it disabled)
    jf = StructuredOutputsParams(json=KEY_HEAVY_SCHEMA, backend=args.backend)
    sp = SamplingParams(temperature=0, max_tokens=200, structured_outputs=jf)
    convs = [[{"role": "user", "content": f"Give customer record number {i} as JSON."}] for i in range(8)]
    res = {}
    for enabled, engine in ((True, llm), (False, None)):
        if engine is None:
            llm.shutdown()
            engine = LLM(args.model, dtype=args.dtype, device=args.device, enable_jump_forward=False,
                         load_format=args.load_format)
        s0 = engine.get_stats()
        dt, n, _ = timed_chat(engine, convs, sp)
        res[enabled] = (n / dt, engine.get_stats().steps - s0.steps, n)
    engine.shutdown()
    on, off = res[True], res[False]
    print(f"\njump-forward (key-heavy schema, 8 requests): on {on[0]:.1f} tok/s in {on[1]} steps, "
          f"off {off[0]:.1f} tok/s in {off[1]} steps ({on[2]} vs {off[2]} tokens): {on[0] / off[0]:.2f}x")


if __name__ == "__main__":
    main()
