"""Structured-output serving benchmark against a running OpenAI-compatible server.

In the style of vLLM's benchmarks/benchmark_serving_structured_output.py:

    formwork serve &
    python bench/serve.py --dataset json --num-prompts 64 --max-concurrency 16
    python bench/serve.py --dataset json-unique --request-rate 4     # defeats the compile cache

Every request streams a chat completion constrained by `response_format`
(json_schema). Reports request / output-token throughput, TTFT, TPOT and ITL
(mean, p50, p99) and the share of outputs that parse and validate against their
schema (all outputs, and those that finished with "stop").
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import jsonschema

BASE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


@dataclass(slots=True)
class BenchRequest:
    prompt: str
    schema: dict


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    valid: bool = False


def make_dataset(kind: str, n: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        schema = copy.deepcopy(BASE_SCHEMA)
        if kind == "json-unique":
            key = f"field_{i}_{rng.randrange(1 << 30):x}"
            schema["properties"][key] = {"type": "string", "maxLength": 12}
            schema["required"].append(key)
        elif kind != "json":
            raise ValueError(f"unknown dataset {kind!r}")
        prompt = ("Generate an example of a user profile as JSON following this schema:\n"
                  f"{json.dumps(schema)}")
        out.append(BenchRequest(prompt, schema))
    return out


def _validate(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


async def send_one(client: httpx.AsyncClient, args, req: BenchRequest) -> Result:
    body = {"model": args.model, "messages": [{"role": "user", "content": req.prompt}],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "profile", "schema": req.schema}}}
    res, parts = Result(), []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    delta = c["delta"].get("content")
                    if delta:
                        now = time.perf_counter()
                        if not parts:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        parts.append(delta)
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.text = "".join(parts)
    res.valid = _validate(res.text, req.schema)
    res.ok = True
    return res


async def run(args, dataset: list[BenchRequest]) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        async def limited(req: BenchRequest) -> Result:
            if sem is None:
                return await send_one(client, args, req)
            async with sem:
                return await send_one(client, args, req)

        tasks = []
        start = time.perf_counter()
        for req in dataset:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    stopped = [r for r in ok if r.finish_reason == "stop"]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "valid_share": sum(r.valid for r in ok) / max(1, len(ok)),
        "valid_share_of_stop": sum(r.valid for r in stopped) / max(1, len(stopped)),
        "errors": [r.error for r in results if not r.ok][:5],
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl)):
        summary[f"mean_{name}_ms"] = statistics.fmean(values) * 1e3 if values else float("nan")
        summary[f"p50_{name}_ms"] = _pct(values, 50) * 1e3
        summary[f"p99_{name}_ms"] = _pct(values, 99) * 1e3
    return summary


def print_summary(s: dict) -> None:
    print("{s:=^60}".format(s=" Structured-output serving benchmark "))
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total output tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Valid outputs (all)", f"{100 * s['valid_share']:.1f} %"),
            ("Valid outputs (finish=stop)", f"{100 * s['valid_share_of_stop']:.1f} %"),
            ("Finish reasons", s["finish_reasons"])]
    for name in ("ttft", "tpot", "itl"):
        rows += [(f"{k} {name.upper()} (ms)", f"{s[f'{k.lower()}_{name}_ms']:.2f}")
                 for k in ("Mean", "P50", "P99")]
    for k, v in rows:
        print(f"{k:<40}{v}")
    for e in s["errors"]:
        print("error:", e)
    print("=" * 60)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("json", "json-unique"), default="json")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate (req/s); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    dataset = make_dataset(args.dataset, args.num_prompts, args.seed)
    results, duration = asyncio.run(run(args, dataset))
    summary = summarize(results, duration)
    print_summary(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
