"""Soak test of a whole `formwork serve` (loopback only; not part of the test suite).

    python bench/soak.py [--num-requests 1000] [--concurrency 64] [--storm 100]

Starts its own server on 127.0.0.1 (a free port, --max-model-len 1024), then:
  1. idle: small plain requests one at a time (their latency at rest);
  2. main: --num-requests at --concurrency, a mix of plain, streamed and
     json_schema-constrained (small bounded schemas, stream or not), max_tokens
     small; 10% of the streamed clients disconnect mid-stream; halfway through
     the engine process (the server's child with the largest RSS, via psutil) is
     killed with SIGKILL; a request refused with 503 (engine restarting) waits
     Retry-After and is sent again;
  3. compile storm: --storm concurrent requests, each with a distinct
     60-property schema, while small plain requests run one at a time; then the
     same storm without schemas (the baseline that tells the compiles' cost
     from the storm's own prefill and decode); --storm-rounds times, each round
     with schemas never seen before;
  4. /metrics: KV blocks held once idle. Then the server gets SIGTERM.
Prints answered / lost / duplicated / invalid / errors by status, p99 latency of
the small plain requests during the storm vs idle, KV blocks held after. Goal: 0
lost, 0 duplicated, 0 invalid, KV back to 0 held. Exit status 1 if not.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import jsonschema
import psutil

SMALL_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                      "tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "maxLength": 6}}},
     "required": ["city", "tags"], "additionalProperties": False},
]
PLAIN = [{"role": "user", "content": "Say hello in three words."}]
JSON_ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@dataclass(slots=True)
class Outcome:
    kind: str
    status: str = "lost"            # answered / error:<status> / disconnected / lost:<why>
    finish: str | None = None
    valid: bool | None = None       # constrained and finished "stop": validates?
    duplicated: bool = False
    retries: int = 0
    latency: float = 0.0
    tokens: int = 0                 # completion tokens (non-streamed answers)
    response_ids: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def storm_schema(i: int) -> dict:
    rnd = random.Random(i)
    types = [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 999},
             {"type": "boolean"}, {"enum": ["a", "b", "c", f"v{i}"]}]
    props = {f"p{i}_{k}_{rnd.randrange(10**6)}": rnd.choice(types) for k in range(60)}
    return {"type": "object", "properties": props, "required": list(props)[:10],
            "additionalProperties": False}


def body_for(kind: str, schema: dict | None, max_tokens: int, stream: bool, model: str = "m") -> dict:
    body = {"model": model, "messages": JSON_ASK if schema else PLAIN, "max_tokens": max_tokens,
            "temperature": 0.7, "stream": stream}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": schema, "strict": True}}
    return body


async def one(client: httpx.AsyncClient, kind: str, body: dict, schema: dict | None,
              disconnect: bool, timeout_s: float = 600.0) -> Outcome:
    out = Outcome(kind)
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_attempts(client, body, schema, disconnect, out), timeout_s)
    except asyncio.TimeoutError:
        out.status = "lost:timeout"
    except httpx.HTTPError as e:
        out.status = f"lost:{type(e).__name__}"
    out.latency = time.perf_counter() - t0
    return out


async def _attempts(client, body, schema, disconnect, out: Outcome) -> None:
    for attempt in range(60):
        out.retries = attempt
        retry_after = await (_stream if body["stream"] else _plain)(client, body, schema,
                                                                      disconnect, out)
        if retry_after is None:
            return
        await asyncio.sleep(min(retry_after, 2.0))
    out.status = "error:503 (gave up)"


def _check(out: Outcome, text: str, finish: str | None, schema: dict | None) -> None:
    out.finish = finish
    if schema is not None and finish == "stop":
        try:
            jsonschema.validate(json.loads(text), schema)
            out.valid = True
        except (ValueError, jsonschema.ValidationError):
            out.valid = False


async def _plain(client, body, schema, _disconnect, out: Outcome) -> float | None:
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code == 503:
        return float(r.headers.get("retry-after", 1))
    if r.status_code != 200:
        out.status = f"error:{r.status_code}"
        return None
    data = r.json()
    out.response_ids.append(data["id"])
    choices = data["choices"]
    out.duplicated = len(choices) != 1
    out.tokens = (data.get("usage") or {}).get("completion_tokens") or 0
    _check(out, choices[0]["message"]["content"] or "", choices[0]["finish_reason"], schema)
    out.status = "answered"
    return None


async def _stream(client, body, schema, disconnect, out: Outcome) -> float | None:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 503:
            return float(r.headers.get("retry-after", 1))
        if r.status_code != 200:
            out.status = f"error:{r.status_code}"
            return None
        text, finishes, dones, chunks, error = "", [], 0, 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                dones += 1
                continue
            data = json.loads(payload)
            if "error" in data:
                error = data["error"]
                continue
            chunks += 1
            if data.get("id") and data["id"] not in out.response_ids:
                out.response_ids.append(data["id"])
            for c in data["choices"]:
                text += c["delta"].get("content") or ""
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
            if disconnect and chunks >= 3:
                out.status = "disconnected"
                return None            # leaving the block closes the connection mid-stream
    out.duplicated = dones > 1 or len(finishes) > 1 or len(out.response_ids) > 1
    if error is not None:
        out.status = f"error:in-stream {error.get('code') or error.get('type')}"
    elif dones == 1 and len(finishes) == 1:
        _check(out, text, finishes[0], schema)
        out.status = "answered"
    else:
        out.status = f"lost:stream ended (done {dones}, finishes {len(finishes)})"
    return None


def engine_pid(server_pid: int) -> int | None:
    """The server's child process holding the model: the largest resident set."""
    kids = psutil.Process(server_pid).children(recursive=True)
    kids = [k for k in kids if k.is_running()]
    return max(kids, key=lambda k: k.memory_info().rss).pid if kids else None


async def small_latencies(client: httpx.AsyncClient, stop: asyncio.Event | None, n: int,
                          model: str = "m", priority: int | None = None) -> list[float]:
    """`n` small plain requests one after another (until `stop`, if given): their latencies;
    `priority`: sent as the request's priority (a server with priority scheduling)."""
    out = []
    body = body_for("small", None, 4, False, model)
    if priority is not None:
        body["priority"] = priority
    while (stop is None and len(out) < n) or (stop is not None and not stop.is_set()):
        t0 = time.perf_counter()
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.1)
    return out


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def p90(xs: list[float]) -> float:
    return quantile(xs, 0.9)


def p99(xs: list[float]) -> float:
    return quantile(xs, 0.99)


async def main_phase(client, args, server_pid: int) -> tuple[list[Outcome], dict]:
    sem = asyncio.Semaphore(args.concurrency)
    done = 0
    info: dict = {}
    kill_at = args.num_requests // 2

    async def run(i: int) -> Outcome:
        nonlocal done
        kind = ("plain", "stream", "json", "json-stream")[i % 4]
        schema = SMALL_SCHEMAS[i % len(SMALL_SCHEMAS)] if kind.startswith("json") else None
        stream = kind.endswith("stream")
        disconnect = stream and random.random() < 0.10
        body = body_for(kind, schema, 48 if schema else 16, stream)
        async with sem:
            o = await one(client, kind, body, schema, disconnect)
        done += 1
        if done == kill_at:
            pid = engine_pid(server_pid)
            info["killed_engine_pid"] = pid
            info["killed_at_s"] = time.perf_counter()
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        return o

    outcomes = await asyncio.gather(*(run(i) for i in range(args.num_requests)))
    return list(outcomes), info


async def storm_phase(client, args, with_schemas: bool, round_: int, model: str = "m",
                      ignore_eos: bool = False, priority: int | None = None
                      ) -> tuple[list[Outcome], list[float]]:
    """--storm requests at once (each with a distinct 60-property schema, or none;
    `ignore_eos`: each runs to max_tokens) while small plain requests run one at a
    time (at `priority`, if given); (their outcomes, the latencies)."""
    stop = asyncio.Event()
    lat_task = asyncio.create_task(small_latencies(client, stop, 0, model, priority))
    await asyncio.sleep(0.2)
    schemas = [storm_schema(round_ * args.storm + i) if with_schemas else None
               for i in range(args.storm)]
    bodies = [body_for("storm", s, args.storm_max_tokens, False, model) for s in schemas]
    if ignore_eos:
        for b in bodies:
            b["ignore_eos"] = True
    outcomes = await asyncio.gather(*(one(client, "storm", b, s, False)
                                      for b, s in zip(bodies, schemas)))
    stop.set()
    return list(outcomes), await lat_task


# The storm phases of measure_storm: (name, with schemas, ignore_eos). A schema storm's
# requests cannot finish a 60-property object in max_tokens, so each writes all of
# them; without schemas most stop at eos after half as many: "plain_equal" is the same
# storm without schemas at the schema storm's output lengths.
STORM_PHASES = (("schemas", True, False), ("plain", False, False), ("plain_equal", False, True))


async def measure_storm(url: str, model: str, rounds: int, storm: int = 100,
                        max_tokens: int = 24, small_priority: int | None = None) -> dict:
    """The storm alone against any OpenAI-compatible server (bench/vs_vllm.py): the
    small plain requests' latency idle and during each of STORM_PHASES (`rounds`
    rounds of new schemas): p50 ms under the phase's name, `<name>_mean` and
    `<name>_p90` ms, and `<name>_tokens` (mean completion tokens of its requests).
    `small_priority`: the small requests' priority (a server scheduling by priority)."""
    args = argparse.Namespace(storm=storm, storm_max_tokens=max_tokens)
    lat: dict = {"idle": []} | {name: [] for name, *_ in STORM_PHASES}
    tokens: dict = {name: [] for name, *_ in STORM_PHASES}
    answered = invalid = 0
    async with httpx.AsyncClient(base_url=url, timeout=600.0,
                                 limits=httpx.Limits(max_connections=storm + 20)) as client:
        await small_latencies(client, None, 3, model)            # warm-up
        lat["idle"] = await small_latencies(client, None, 20, model, small_priority)
        for r in range(rounds):
            for name, with_schemas, ignore_eos in STORM_PHASES:
                outs, got = await storm_phase(client, args, with_schemas, r, model, ignore_eos,
                                              small_priority)
                answered += sum(o.status == "answered" for o in outs)
                invalid += sum(o.valid is False for o in outs)
                lat[name] += got
                tokens[name] += [o.tokens for o in outs]
    res = {k: 1000 * p50(v) for k, v in lat.items()}
    res |= {f"{k}_mean": 1000 * statistics.fmean(v) for k, v in lat.items() if v}
    res |= {f"{k}_p90": 1000 * p90(v) for k, v in lat.items() if v}
    res |= {f"{k}_tokens": statistics.fmean(v) for k, v in tokens.items() if v}
    return res | {"answered": answered, "invalid": invalid,
                  "requests": len(STORM_PHASES) * storm * rounds, "load1": os.getloadavg()[0]}


async def kv_held(client) -> float | None:
    text = (await client.get("/metrics")).text
    m = re.search(r"^formwork_kv_cache_held_blocks\S*\s+([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def soak(args, url: str, server_pid: int) -> int:
    limits = httpx.Limits(max_connections=args.concurrency + args.storm + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        idle = await small_latencies(client, None, 20)
        t0 = time.perf_counter()
        outcomes, info = await main_phase(client, args, server_pid)
        main_s = time.perf_counter() - t0
        storm, storm_lat, base_lat = [], [], []
        for r in range(args.storm_rounds):
            for with_schemas, lat in ((True, storm_lat), (False, base_lat)):
                out, got = await storm_phase(client, args, with_schemas, r)
                storm += out
                lat += got
        await asyncio.sleep(2.0)
        held = await kv_held(client)
    all_out = outcomes + storm
    ids = Counter(i for o in all_out for i in o.response_ids)
    dup = sum(o.duplicated for o in all_out) + sum(n > 1 for n in ids.values())
    statuses = Counter(o.status for o in all_out)
    lost = sum(n for s, n in statuses.items() if s.startswith("lost"))
    invalid = sum(o.valid is False for o in all_out)
    checked = sum(o.valid is not None for o in all_out)
    print(f"main phase: {len(outcomes)} requests in {main_s:.1f} s (concurrency {args.concurrency}); "
          f"engine pid {info.get('killed_engine_pid')} killed with SIGKILL halfway")
    print(f"storm: {args.storm_rounds} x ({args.storm} requests each with a distinct 60-property "
          f"schema, then {args.storm} without), max_tokens {args.storm_max_tokens}")
    print(f"answered     {statuses['answered']}")
    print(f"disconnected {statuses['disconnected']} (clients that left mid-stream on purpose)")
    print(f"lost         {lost}")
    print(f"duplicated   {dup}")
    print(f"invalid      {invalid} (of {checked} constrained outputs that finished 'stop')")
    print(f"retried after 503: {sum(o.retries > 0 for o in all_out)} requests")
    print("statuses:     " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print("finish:       " + ", ".join(f"{s}: {n}" for s, n in
                                       sorted(Counter(str(o.finish) for o in all_out).items())))
    print("small plain request latency (p50 / p99 / n):")
    for name, xs in (("idle", idle), ("during the schema storm", storm_lat),
                     ("during the same storm without schemas", base_lat)):
        print(f"  {name:38s} {p50(xs):.3f} s / {p99(xs):.3f} s / {len(xs)}")
    print(f"  schema storm / idle p50: {p50(storm_lat) / p50(idle):.2f}; schema storm / storm "
          f"without schemas p50: {p50(storm_lat) / p50(base_lat):.2f}")
    print(f"KV blocks held after: {held}")
    ok = lost == 0 and dup == 0 and invalid == 0 and held == 0
    print("RESULT: " + ("ok" if ok else "NOT ok"))
    return 0 if ok else 1


def start_server(args, port: int, log_path: pathlib.Path) -> subprocess.Popen:
    exe = pathlib.Path(sys.executable).with_name("formwork")
    cmd = [str(exe), "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(args.max_model_len),
           "--served-model-name", "m", "--log-level", "warning", *args.serve_args]
    print("server:", " ".join(cmd), f"(log: {log_path})")
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited during start-up (code {proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("server not ready in time")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--storm", type=int, default=100, help="concurrent distinct-schema requests")
    p.add_argument("--storm-rounds", type=int, default=1,
                   help="schema storm + the same storm without schemas, this many times")
    p.add_argument("--storm-max-tokens", type=int, default=24,
                   help="max_tokens of each storm request (1: the compiles alone, no decode load)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--model", default=None)
    p.add_argument("--log", default="/tmp/formwork-soak-server.log")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="more `formwork serve` flags (after --)")
    args = p.parse_args()
    random.seed(args.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, pathlib.Path(args.log))
    try:
        wait_ready(url, proc)
        return asyncio.run(soak(args, url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
