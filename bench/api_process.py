"""Start-up cost of the API process of `formwork serve` (not its engine child).

Starts `formwork serve` on 127.0.0.1 (through a thin wrapper that answers SIGUSR1
with the API process's heavy modules), waits for /health, optionally sends one
structured-output request (which runs the admission checks), reads the API pid's
VmRSS / VmHWM and the heavy native libraries mapped into it, stops the server
and prints a table. Then, without an engine, times the API side alone in a
fresh interpreter: importing the app, building it, loading the tokenizer.

    python bench/api_process.py                     # default model, port 18431
    python bench/api_process.py --structured        # also one json_schema request
    python bench/api_process.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

HEAVY = ("torch", "transformers", "xgrammar", "outlines_core", "llguidance")
LIBS = {"torch": ("libtorch", "torch/_C"), "xgrammar": ("xgrammar",),
        "outlines_core": ("outlines_core",), "llguidance": ("llguidance",)}
# the API side alone, as `formwork serve` does it before spawning the engine
API_ONLY = """
import json, resource, sys, time
t0 = time.perf_counter()
from formwork.gateway.api_server import build_app
from formwork.gateway.limits import longest_token_chars
from formwork.schemas.config import EngineConfig
build_app(EngineConfig(model={model!r}), served_model_names=["m"])
t_import = time.perf_counter() - t0
try:
    from formwork.gpu.model_files import load_model_tokenizer as load
except ImportError:                      # before gpu/model_files.py (issue #15)
    from formwork.core.tokenizer import load_tokenizer as load
tok = load({model!r})
longest_token_chars(tok)
print(json.dumps({{"import_s": t_import, "tokenizer_s": time.perf_counter() - t0 - t_import,
    "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def child(dump: str) -> int:
    """The API process: `formwork serve` with a SIGUSR1 handler that writes which
    heavy modules it holds to `dump`."""
    def on_usr1(*_):
        pathlib.Path(dump).write_text(json.dumps([m for m in HEAVY if m in sys.modules]))
    signal.signal(signal.SIGUSR1, on_usr1)
    from formwork.gateway.cli import main     # here: the measuring parent imports no formwork
    return main(sys.argv[sys.argv.index("--") + 1:])


def rss_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def mapped(pid: int) -> list[str]:
    maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
    return [name for name, needles in LIBS.items() if any(n in maps for n in needles)]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server not ready")


def structured_request(port: int) -> int:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a json"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    return r.status_code


def measure_server(args) -> dict:
    dump = os.path.join(tempfile.mkdtemp(prefix="formwork-api-"), "modules.json")
    cmd = [sys.executable, __file__, "--child", dump, "--", "serve", "--host", "127.0.0.1",
           "--port", str(args.port), "--served-model-name", "m"]
    if args.model:
        cmd.insert(cmd.index("--host"), args.model)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_ready(args.port, proc, args.timeout) - t0
        out = {"ready_s": ready_s}
        if args.structured:
            out["structured_status"] = structured_request(args.port)
        time.sleep(0.5)
        out.update(rss_mb(proc.pid))
        out["mapped"] = mapped(proc.pid)
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(50):
            if os.path.exists(dump):
                break
            time.sleep(0.1)
        out["heavy"] = json.loads(pathlib.Path(dump).read_text())
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.dirname(dump), ignore_errors=True)


def measure_api_only(args) -> dict:
    code = API_ONLY.format(model=args.model, heavy=HEAVY)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def main() -> int:
    if "--child" in sys.argv:
        return child(sys.argv[sys.argv.index("--child") + 1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--structured", action="store_true", help="send one json_schema request")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    server = measure_server(args)
    alone = measure_api_only(args)
    rows = [
        ("formwork serve: /health ready (s)", f"{server['ready_s']:.1f}"),
        ("API process VmRSS / VmHWM (MB)", f"{server['VmRSS']:.0f} / {server['VmHWM']:.0f}"),
        ("API process heavy modules", ", ".join(server["heavy"]) or "-"),
        ("API process heavy libs mapped", ", ".join(server["mapped"]) or "-"),
        ("API alone: import + build_app (s)", f"{alone['import_s']:.2f}"),
        ("API alone: tokenizer (s)", f"{alone['tokenizer_s']:.2f}"),
        ("API alone: interpreter wall (s)", f"{alone['wall_s']:.2f}"),
        ("API alone: max RSS (MB)", f"{alone['maxrss_mb']:.0f}"),
        ("API alone: heavy modules", ", ".join(alone["heavy"]) or "-"),
    ]
    if args.structured:
        rows.insert(1, ("json_schema request status", str(server["structured_status"])))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"server": server, "api_only": alone}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
