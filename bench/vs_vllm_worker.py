"""One system's offline workloads for bench/vs_vllm.py, run in that system's own
interpreter (the project's venv for formwork, the cached vLLM venv for vLLM).

Imports nothing from formwork at module level: the vLLM venv does not have it.
Prints one line `RESULT {json}` on stdout.

    python bench/vs_vllm_worker.py --system formwork --model-dir DIR --workloads mixed,b1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# The structured workload's schema: a string whose minLength is beyond max_tokens, so
# constrained and free runs produce exactly the same number of tokens.
LONG_SCHEMA = {"type": "object",
               "properties": {"story": {"type": "string", "minLength": 800}},
               "required": ["story"], "additionalProperties": False}
# Early-stop workload: a small record; requests finish when the object closes.
SMALL_SCHEMA = {"type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24},
                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "city": {"enum": ["Paris", "Lagos", "Lima", "Osaka", "Oslo"]}},
                "required": ["name", "age", "city"], "additionalProperties": False}
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import make_workload as mixed_workload  # noqa: E402  (imports no formwork)

TOPICS = ["a lighthouse", "a robot", "the ocean", "a mountain", "a city", "a forest", "a dragon", "a train"]


def story_chats(n: int):
    return [[{"role": "user", "content": f"Write a JSON object with a long story about {TOPICS[i % 8]}."}]
            for i in range(n)]


def record_chats(n: int):
    return [[{"role": "user", "content": f"Give person record number {i} as JSON with name, age and city."}]
            for i in range(n)]


class System:
    """The thin part that differs between formwork and vLLM."""

    def __init__(self, name: str, model_dir: str, args):
        self.name = name
        if name == "formwork":
            from formwork import LLM, SamplingParams, StructuredOutputsParams
            self.llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len)
            self._token_prompt = lambda ids: {"prompt_token_ids": ids}
        else:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import StructuredOutputsParams
            self.llm = LLM(model=model_dir, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len, enable_prefix_caching=True,
                           enable_chunked_prefill=True, seed=0)
            self._token_prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)
        self.SP, self.SO = SamplingParams, StructuredOutputsParams

    def params(self, max_tokens: int, *, schema=None, ignore_eos=False, temperature=0.0):
        kw = {"temperature": temperature, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
        if schema is not None:
            kw["structured_outputs"] = self.SO(json=schema)
        return self.SP(**kw)

    def generate_ids(self, prompts, params):
        outs = self.llm.generate([self._token_prompt(p) for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def chat(self, convs, params):
        outs = self.llm.chat(convs, params, use_tqdm=False)
        return [(len(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def mixed_requests(tok, n: int) -> list[tuple[list[int], int]]:
    """The mixed workload both systems get: offline_throughput's, its default seed."""
    return mixed_workload(tok, n, seed=0)


def run_mixed(sys_, tok, args, temperature: float = 0.0):
    reqs = mixed_requests(tok, args.num_requests)
    params = [sys_.params(o, ignore_eos=True, temperature=temperature) for _, o in reqs]
    sys_.generate_ids([p for p, _ in reqs[:2]], params[:2])
    t0 = time.perf_counter()
    counts = sys_.generate_ids([p for p, _ in reqs], params)
    dt = time.perf_counter() - t0
    assert counts == [o for _, o in reqs], "a request produced a different token count"
    total = sum(len(p) for p, _ in reqs) + sum(counts)
    return {"total_tok_s": total / dt, "output_tok_s": sum(counts) / dt, "seconds": dt,
            "load1": os.getloadavg()[0]}


def run_structured(sys_, tok, args):
    convs = story_chats(args.batch)
    free = sys_.params(args.output_len, ignore_eos=True)
    cons = sys_.params(args.output_len, schema=LONG_SCHEMA)
    sys_.chat(convs[:2], cons)                     # warm-up and compile
    best_f = best_c = 0.0
    for _ in range(args.reps):                     # alternate, so noise hits both
        t0 = time.perf_counter()
        nf = sum(n for n, _, _ in sys_.chat(convs, free))
        best_f = max(best_f, nf / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        res = sys_.chat(convs, cons)
        best_c = max(best_c, sum(n for n, _, _ in res) / (time.perf_counter() - t0))
        assert all(n == args.output_len for n, _, _ in res), "constrained outputs ended early"
        assert all(t.startswith('{') for _, t, _ in res), "constrained output is not JSON"
    return {"constrained_tok_s": best_c, "free_tok_s": best_f, "ratio": best_c / best_f,
            "load1": os.getloadavg()[0]}


def run_early_stop(sys_, tok, args):
    import jsonschema
    convs = record_chats(args.batch)
    sp = sys_.params(128, schema=SMALL_SCHEMA)
    sys_.chat(convs[:2], sp)
    best, valid = 0.0, 0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        res = sys_.chat(convs, sp)
        best = max(best, len(res) / (time.perf_counter() - t0))
        valid = 0
        for _, text, _ in res:
            try:
                jsonschema.validate(json.loads(text), SMALL_SCHEMA)
                valid += 1
            except Exception:
                pass
    return {"requests_s": best, "valid": valid, "of": len(convs), "load1": os.getloadavg()[0]}


def run_batch1(sys_, tok, args):
    prompt = tok("Write a long story about a lighthouse keeper and the sea.",
                 add_special_tokens=False).input_ids
    n = args.b1_tokens
    sys_.generate_ids([prompt], [sys_.params(8, ignore_eos=True)])
    diffs = []
    for _ in range(3):
        t0 = time.perf_counter()
        sys_.generate_ids([prompt], [sys_.params(1, ignore_eos=True)])
        t1 = time.perf_counter()
        sys_.generate_ids([prompt], [sys_.params(n + 1, ignore_eos=True)])
        t2 = time.perf_counter()
        diffs.append(((t2 - t1) - (t1 - t0)) / n)
    return {"decode_ms_per_token": statistics.median(diffs) * 1e3, "load1": os.getloadavg()[0]}


def run_mixed_sampled(sys_, tok, args):
    """The mixed workload at temperature 1 (OpenAI's default): the sampler's own cost.
    Run in a fresh process (bench/vs_vllm.py): the greedy run's prompts would be
    prefix-cache hits."""
    return run_mixed(sys_, tok, args, temperature=1.0)


WORKLOADS = {"mixed": run_mixed, "mixed_sampled": run_mixed_sampled, "structured": run_structured,
             "early_stop": run_early_stop, "b1": run_batch1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=("formwork", "vllm"), required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--b1-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t0 = time.perf_counter()
    sys_ = System(args.system, args.model_dir, args)
    out = {"startup_s": time.perf_counter() - t0}
    for w in args.workloads.split(","):
        out[w] = WORKLOADS[w](sys_, tok, args)
        print(f"{args.system} {w}: {out[w]}", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    if args.system == "formwork":
        sys_.llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
