"""Scale-out on one machine: one engine vs data-parallel engines vs tensor-parallel
workers, side by side in one run, the same mixed workload (bench/offline_throughput.py's
generator: prompts 20-600 tokens, outputs 16-256, ignore_eos) and a batch-1 decode.

Each configuration gets the same cores in all: `--cores` (default: all of them)
split between its engines / ranks (torch threads per process = cores / processes).
On a 2-core box this measures overheads, not speed-ups: the point of DP and TP is
more devices than one, which this machine does not have.

    python bench/scale_out.py                       # dp1, dp2, tp2 on 48 requests
    python bench/scale_out.py --configs dp1 tp2 --num-requests 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONFIGS = {           # name -> (data_parallel_size, tensor_parallel_size)
    "dp1": (1, 1), "dp2": (2, 1), "tp2": (1, 2), "tp3": (1, 3),
}


def load_avg() -> str:
    return "%.2f/%.2f/%.2f" % os.getloadavg()


def run(name: str, args, reqs) -> dict:
    from offline_throughput import timed_generate

    from formwork import LLM, SamplingParams

    dp, tp = CONFIGS[name]
    threads = max(1, args.cores // (dp * tp))
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              num_threads=threads, data_parallel_size=dp, tensor_parallel_size=tp,
              kv_cache_memory_gb=args.kv_cache_memory_gb)
    load_s = time.perf_counter() - t0
    try:
        mixed_s, n_out = timed_generate(llm, reqs)
        n_in = sum(len(p) for p, _ in reqs)
        one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": reqs[0][0][:32]}], [one], use_tqdm=False)
        decode_ms = (time.perf_counter() - t0) * 1e3 / args.decode_tokens
    finally:
        llm.shutdown()
    return {"config": name, "dp": dp, "tp": tp, "threads_per_process": threads,
            "load_s": round(load_s, 1), "mixed_total_tok_s": round((n_in + n_out) / mixed_s, 1),
            "mixed_output_tok_s": round(n_out / mixed_s, 1),
            "batch1_ms_per_token": round(decode_ms, 1), "load_avg": load_avg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", nargs="+", default=["dp1", "dp2", "tp2"], choices=sorted(CONFIGS))
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line per configuration")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from offline_throughput import make_workload

    from formwork.gpu.model_files import load_model_tokenizer

    reqs = make_workload(load_model_tokenizer(args.model), args.num_requests, args.seed)
    rows = [run(name, args, reqs) for name in args.configs]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    base = rows[0]["mixed_total_tok_s"]
    print(f"{args.num_requests} mixed requests, {args.dtype}, {args.cores} cores in all")
    print("| config | processes x threads | mixed total tok/s | vs first | batch-1 ms/token | load avg |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['dp'] * r['tp']} x {r['threads_per_process']} | "
              f"{r['mixed_total_tok_s']} | {r['mixed_total_tok_s'] / base:.2f} | "
              f"{r['batch1_ms_per_token']} | {r['load_avg']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
