"""Decode throughput with CUDA graphs vs eager: same engine, same workload, side by side.

For each batch size B: B requests of --prompt-len random tokens, each decoding
--output-len tokens (greedy, ignore_eos), submitted together, so nearly every
step is a pure decode of B rows (B not a capture size -> padded). Each (mode,
B) runs once untimed (Triton specializations, allocator) and once timed. The
eager engine (enforce_eager) runs first, then the graph engine; same fixed KV
cache size, same dtype. Also reports which path the forwards took and whether
both modes produced the same tokens.

    python bench/gpu/decode_graphs.py --model DIR [--device cuda] [--batch-sizes 1,8,12,64] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time


def run_mode(args, eager: bool, workloads: dict[int, list[list[int]]]) -> dict:
    import torch
    from formwork import LLM, SamplingParams

    max_bs = max(workloads)
    per_seq = -(-(args.prompt_len + args.output_len) // args.block_size) + 1
    t0 = time.perf_counter()
    # in-process: the benchmark reads the runner's graph/eager step counts
    llm = LLM(args.model, engine_process=False, dtype=args.dtype, device=args.device,
              enforce_eager=eager, load_format=args.load_format,
              max_num_seqs=max_bs, block_size=args.block_size, num_kv_blocks=max_bs * per_seq + 16,
              max_num_batched_tokens=max(2048, args.prompt_len))
    res = {"start_s": time.perf_counter() - t0, "graph_sizes": list(llm.engine.info.cuda_graph_sizes),
           "batches": {}}
    runner = llm.engine.executor.runner
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for bs, prompts in workloads.items():
        reqs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(reqs, params, use_tqdm=False)                      # untimed
        paths_before, steps_before = dict(runner.step_paths), llm.get_stats().steps
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        res["batches"][bs] = {
            "seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt,
            "ms_per_step": 1e3 * dt / max(1, llm.get_stats().steps - steps_before),
            "graph_forwards": runner.step_paths["graph"] - paths_before.get("graph", 0),
            "eager_forwards": runner.step_paths["eager"] - paths_before.get("eager", 0),
            "tokens": [o.outputs[0].token_ids for o in outs],
        }
    llm.shutdown()
    del llm, runner
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--batch-sizes", default="1,8,12,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights from config.json alone (bench/gpu/random_model.py)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    from formwork.gpu.model_files import resolve_model
    args.model = str(resolve_model(args.model, weights=args.load_format != "dummy"))
    rng = random.Random(args.seed)
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    workloads = {b: [[rng.randrange(100, 10000) for _ in range(args.prompt_len)] for _ in range(b)]
                 for b in sizes}
    res = {"eager": run_mode(args, True, workloads), "graph": run_mode(args, False, workloads)}
    print(f"dtype {args.dtype}, prompt {args.prompt_len} + {args.output_len} output tokens per request; "
          f"graph sizes captured: {res['graph']['graph_sizes'] or 'none'} "
          f"(start-up {res['eager']['start_s']:.1f}s eager, {res['graph']['start_s']:.1f}s graph)")
    print("| batch | eager tok/s | graph tok/s | speed-up | eager ms/step | graph ms/step "
          "| graph / eager forwards (graph mode) | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for b in sizes:
        e, g = res["eager"]["batches"][b], res["graph"]["batches"][b]
        same = sum(x == y for x, y in zip(e["tokens"], g["tokens"]))
        print(f"| {b} | {e['tok_per_s']:.0f} | {g['tok_per_s']:.0f} | {g['tok_per_s'] / e['tok_per_s']:.2f}x "
              f"| {e['ms_per_step']:.2f} | {g['ms_per_step']:.2f} | {g['graph_forwards']} / {g['eager_forwards']} "
              f"| {same}/{b} |")
    if args.json:
        for mode in res.values():
            for r in mode["batches"].values():
                r.pop("tokens")
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
