"""bench/vs_vllm.py's pieces that can be checked without vLLM: the worker loads
in an interpreter without formwork (as the vLLM venv is), and the table
computes the ratios the right way round."""
import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_table_ratios(capsys):
    vs = _load("vs_vllm")
    def res(mixed, b1):
        return {"offline": {"mixed": {"total_tok_s": mixed, "load1": 1.0},
                            "b1": {"decode_ms_per_token": b1, "load1": 1.0}}}
    vs.print_table({"formwork": res(150.0, 20.0), "vllm": res(100.0, 30.0)}, ["formwork", "vllm"])
    out = capsys.readouterr().out
    assert "| mixed: 64 requests, total tok/s | 150.0 | 100.0 | **1.50** |" in out
    assert "| 20.0 | 30.0 | **1.50** (vLLM ms ÷ formwork ms) |" in out      # lower is better


def test_table_storm_rows(capsys):
    vs = _load("vs_vllm")
    def res(idle, schemas, plain, equal):
        lat = {"idle": idle, "schemas": schemas, "plain": plain, "plain_equal": equal}
        return {"storm": lat | {f"{k}_mean": 2 * v for k, v in lat.items()}
                | {f"{k}_p90": 3 * v for k, v in lat.items()}
                | {"schemas_tokens": 24.0, "plain_tokens": 12.5, "plain_equal_tokens": 24.0,
                   "answered": 600, "invalid": 0, "requests": 600, "load1": 1.0}}
    vs.print_table({"formwork": res(100.0, 300.0, 200.0, 250.0), "vllm": res(120.0, 240.0, 180.0, 160.0)},
                   ["formwork", "vllm"])
    out = capsys.readouterr().out
    assert "| ... during 100 distinct-schema requests, ms | 300.0 | 240.0 | **0.80**" in out
    assert "| schema storm ÷ idle (#13 goal: <= 2) | 3.00 | 2.00 | **0.67**" in out
    assert "| schema storm ÷ the same lengths without schemas | 1.20 | 1.50 | **1.25**" in out
    assert "formwork storm requests answered: 600 of 600, invalid 0" in out
    assert ("formwork storm small-request latency mean / p90 ms: idle 200 / 300, schemas 600 / 900, "
            "plain 400 / 600, plain_equal 500 / 750; completion tokens per storm request: "
            "schemas 24.0, plain 12.5, plain_equal 24.0") in out


def test_worker_imports_no_formwork():
    import subprocess
    code = ("import sys; sys.modules['formwork'] = None; sys.argv = ['w']; "
            f"sys.path.insert(0, {str(BENCH)!r}); import vs_vllm_worker; "
            "assert vs_vllm_worker.mixed_workload.__module__ == 'offline_throughput'; "
            # the worker's call of the shared generator (its signature once drifted)
            "import types; tok = lambda text, add_special_tokens: types.SimpleNamespace("
            "input_ids=list(range(4000))); "
            "reqs = vs_vllm_worker.mixed_requests(tok, 3); "
            "assert len(reqs) == 3 and all(20 <= len(p) <= 600 for p, _ in reqs)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
