"""Offline throughput: formwork's engine vs HF transformers `generate` on the
same mixed workload, in one process, same dtype and thread count.

Workload: N requests, prompt lengths uniform in [20, 600] tokens, output lengths
uniform in [16, 256] tokens (ignore_eos, so both systems produce exactly the
requested tokens). HF runs static batches (padded, left-aligned); a batch runs
until its longest request is done, as `generate` does. Only requested tokens
are counted for either system.

    python bench/offline_throughput.py                   # 64 requests, bf16
    python bench/offline_throughput.py --num-requests 128 --hf-batch-size 16
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time


def make_workload(tokenizer, n: int, seed: int, pmin=20, pmax=600, omin=16, omax=256):
    rng = random.Random(seed)
    vocab_text = ("The quick brown fox jumps over the lazy dog while engineers benchmark "
                  "structured generation engines on small machines with continuous batching. ")
    base = tokenizer(vocab_text * 80, add_special_tokens=False).input_ids
    reqs = []
    for i in range(n):
        plen = rng.randint(pmin, pmax)
        start = rng.randint(0, len(base) - plen - 1)
        reqs.append((base[start:start + plen], rng.randint(omin, omax)))
    return reqs


def timed_generate(llm, reqs) -> tuple[float, int]:
    """Greedy, ignore_eos, after a 2-request warm-up: (seconds, output tokens)."""
    from formwork import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)          # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs), "formwork produced a different token count"
    return dt, n_out


def run_formwork(args, reqs):
    from formwork import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
              load_format=args.load_format)
    load = time.perf_counter() - t0
    dt, n_out = timed_generate(llm, reqs)
    stats = llm.get_stats()
    llm.shutdown()
    return {"seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt, "load_s": load,
            "steps": stats.steps, "preemptions": stats.num_preemptions}


def _device(args):
    import torch
    return torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def run_hf(args, reqs, model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    from formwork.gpu.rank_setup import resolve_dtype
    device = _device(args)
    dtype = resolve_dtype(args.dtype, device)          # the same dtype formwork picked
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 2
    order = list(range(len(reqs)))     # arrival order, like a static batcher would see
    t0 = time.perf_counter()
    n_out = 0
    starts = list(range(0, len(order), args.hf_batch_size))
    if args.hf_max_batches:            # a prefix of the same random workload: tok/s is a rate
        starts = starts[:args.hf_max_batches]
    for b in starts:
        batch = [reqs[i] for i in order[b:b + args.hf_batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        max_new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                           max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           pad_token_id=pad)
        n_out += sum(o for _, o in batch)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both systems")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights from config.json alone (implies --skip-hf)")
    ap.add_argument("--hf-max-batches", type=int, default=0,
                    help="run only the first N HF static batches (the baseline is slow on 2 cores); "
                         "its tok/s is measured over those requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from formwork.gpu.model_files import load_model_tokenizer, resolve_model
    weights = args.load_format != "dummy"
    args.skip_hf = args.skip_hf or not weights
    model_dir = resolve_model(args.model, weights=weights)
    tok = load_model_tokenizer(args.model, weights=weights)
    reqs = make_workload(tok, args.num_requests, args.seed)
    res = {"workload": {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs),
                        "output_tokens": sum(o for _, o in reqs)},
           "threads": torch.get_num_threads(), "dtype": args.dtype}
    if args.dtype == "auto":
        from formwork.gpu.rank_setup import resolve_dtype
        res["dtype"] = args.dtype = str(resolve_dtype("auto", _device(args))).removeprefix("torch.")
    res["formwork"] = run_formwork(args, reqs)
    print(f"formwork: {res['formwork']}", file=sys.stderr, flush=True)
    if not args.skip_hf:
        res["hf"] = run_hf(args, reqs, model_dir)
        res["ratio"] = res["formwork"]["tok_per_s"] / res["hf"]["tok_per_s"]
    if args.json:
        print(json.dumps(res))
        return
    w = res["workload"]
    print(f"workload: {w['requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens; "
          f"dtype {res['dtype']}, {res['threads']} torch threads")
    print("| system | seconds | output tok/s |\n|---|---|---|")
    print(f"| formwork | {res['formwork']['seconds']:.1f} | {res['formwork']['tok_per_s']:.1f} |")
    if "hf" in res:
        print(f"| HF generate (static batches of {args.hf_batch_size}; {res['hf']['output_tokens']} tokens) "
              f"| {res['hf']['seconds']:.1f} | "
              f"{res['hf']['tok_per_s']:.1f} |")
        print(f"ratio formwork / HF: {res['ratio']:.2f}x")


if __name__ == "__main__":
    main()
