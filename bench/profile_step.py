"""Where a decode step's time goes, at batch 1 and batch 48 (default model, bf16).

    python bench/profile_step.py                 # batch 1 and 48, 48 decode steps each
    python bench/profile_step.py --batches 1 --steps 64 --top 25

For each batch size: B requests (80-token prompts, ignore_eos) are prefilled,
then `--steps` pure decode steps are timed phase by phase on the engine's own
clocks (schedule + bookkeeping on the engine thread, the forward on the forward
thread, the sampler), and a torch profiler pass over the same kind of steps
groups the forward's ops into matmuls / attention / elementwise+norm / other.
Engine in-process (engine_process=False) so its internals can be timed; the
thread count is whatever the engine picked.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

CATEGORIES = (   # (category, substrings of aten op names), first match wins
    ("matmul", ("mm", "linear", "matmul", "addmm", "bmm", "baddbmm")),
    ("attention", ("scaled_dot_product", "attention", "paged", "softmax", "decode")),
    ("sampler", ("argmax", "topk", "sort", "multinomial", "log_softmax", "exponential", "cumsum")),
    ("elementwise/norm", ("mul", "add", "silu", "rsqrt", "pow", "mean", "neg", "cat", "sub", "div",
                          "copy", "to", "index", "embedding", "where", "masked", "fill", "clone",
                          "contiguous", "slice", "view", "select", "split", "chunk", "unsqueeze",
                          "reshape", "expand", "empty", "zeros", "ones", "full", "as_strided")),
)


def categorize(name: str) -> str:
    n = name.lower().split("::", 1)[-1]
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def copy_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """This machine's memory bandwidth as torch sees it: a large copy_ (bytes read +
    bytes written per second), median of `reps`, at the caller's thread count."""
    import torch
    src = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(ts) / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step must read: every parameter once (the tied
    embedding is read whole by the lm_head; packed copies replace, not add)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run(llm, batch: int, steps: int, top: int, prompt_len: int = 80) -> None:
    import torch
    from formwork import SamplingParams
    eng = llm.engine
    ex = eng.executor
    runner = ex.runner
    tok = llm.tokenizer
    base = tok("The quick brown fox jumps over the lazy dog. " * (40 + prompt_len // 8),
               add_special_tokens=False).input_ids
    sample_s: list[float] = []
    orig_sample = runner.sample

    def timed_sample(*a, **k):
        t = time.perf_counter()
        try:
            return orig_sample(*a, **k)
        finally:
            sample_s.append(time.perf_counter() - t)
    runner.sample = timed_sample

    def add_batch(tag, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):
            for er in llm._processor.add_request(f"{tag}-{batch}-{i}", None, base[i:i + prompt_len], sp,
                                                 time.monotonic()):
                eng.add_request(er)

    def prefill():
        sch = eng.scheduler
        while sch.waiting or any(r.num_output_tokens == 0 for r in sch.running):
            eng.step()

    def decode_phase(n_steps, profile=None):
        rows = []
        for _ in range(n_steps):
            sample_s.clear()
            t0 = time.perf_counter()
            eng.step()
            wall = time.perf_counter() - t0
            t = ex.timings
            fwd = t["forward_end"] - t["forward_start"]
            smp = sum(sample_s)
            rows.append((wall, t["submitted"] - t0, fwd, smp))
            if profile is not None:
                profile.step()
        return rows

    # timed pass: prefill (until every request has its first token), then decode steps
    add_batch("t", steps + 4)
    prefill()
    rows = decode_phase(steps)
    while eng.has_unfinished_requests():
        eng.step()
    med = lambda i: statistics.median(r[i] for r in rows) * 1e3      # noqa: E731
    wall, sched, fwd, smp = med(0), med(1), med(2), med(3)
    print(f"\n## batch {batch}, {prompt_len}-token prompts: {steps} decode steps, threads {torch.get_num_threads()} (caller), "
          f"engine forward threads {eng.get_stats().forward_threads or 'fixed'}")
    print("| phase (median ms per step) | ms | share |\n|---|---|---|")
    for name, v in (("step wall", wall), ("schedule (engine thread, before submit)", sched),
                    ("forward (forward thread)", fwd), ("sampler (forward thread)", smp),
                    ("rest: grammar fill, waits, output update", max(wall - sched - fwd - smp, 0.0))):
        print(f"| {name} | {v:.2f} | {v / wall:.0%} |")
    print(f"decode tok/s at this batch: {batch / (wall / 1e3):.1f}")
    if batch == 1:
        import torch as _t
        prev = _t.get_num_threads()
        _t.set_num_threads(eng.get_stats().forward_threads or prev)
        bw = copy_bandwidth_gbs()
        _t.set_num_threads(prev)
        wb = weight_bytes_per_token(runner.model)
        floor = wb / (bw / 2 * 1e9) * 1e3      # the copy moved bw/2 GB/s each way
        print(f"bandwidth floor: {wb / 1e6:.0f} MB of weights per token / {bw / 2:.1f} GB/s read "
              f"(copy_ {bw:.1f} GB/s read+write) = {floor:.1f} ms; this step is {wall / floor:.2f}x the floor")

    # profiled pass
    add_batch("p", steps + 4)
    prefill()
    from torch.profiler import ProfilerActivity, profile
    # the forward and the sampler run on the executor's worker thread: profile there
    prof = profile(activities=[ProfilerActivity.CPU])
    ex._pool.submit(prof.__enter__).result()
    try:
        decode_phase(min(steps, 16))
    finally:
        ex._pool.submit(prof.__exit__, None, None, None).result()
    while eng.has_unfinished_requests():
        eng.step()
    runner.sample = orig_sample
    evs = [e for e in prof.key_averages() if "::" in e.key]      # aten::, mkldnn::, formwork::
    by_cat = collections.Counter()
    for e in evs:
        by_cat[categorize(e.key)] += e.self_cpu_time_total
    total = sum(by_cat.values()) or 1
    n = min(steps, 16)
    print("\n| op category (self CPU, all threads) | ms per step | share |\n|---|---|---|")
    for cat, us in by_cat.most_common():
        print(f"| {cat} | {us / 1e3 / n:.2f} | {us / total:.0%} |")
    outside = (fwd + smp) - total / 1e3 / n
    print(f"| outside torch ops (Python, the C++ decode-attention kernel) | {max(outside, 0):.2f} | - |")
    print(f"\ntop {top} aten ops by self CPU time:")
    print("| op | calls per step | ms per step |\n|---|---|---|")
    for e in sorted(evs, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"| {e.key} | {e.count / n:.0f} | {e.self_cpu_time_total / 1e3 / n:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=80, help="tokens per prompt (the decode context)")
    args = ap.parse_args(argv)
    import os
    from formwork import LLM
    llm = LLM(engine_process=False, dtype=args.dtype, max_num_seqs=max(args.batches),
              max_model_len=max(2048, args.prompt_len + args.steps + 64))
    for b in args.batches:
        run(llm, b, args.steps, args.top, args.prompt_len)
    print(f"\nload average: {os.getloadavg()[0]:.2f}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
