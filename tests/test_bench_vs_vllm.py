"""bench/vs_vllm.py's pieces that can be checked without vLLM: its workload is
the one bench/offline_throughput.py measures, and its table computes the ratios
the right way round."""
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


class _Tok:
    """Word-level stand-in tokenizer: ids are word positions."""
    def __call__(self, text, add_special_tokens=False):
        return type("E", (), {"input_ids": list(range(len(text.split())))})()


def test_worker_workload_is_offline_throughputs():
    worker, offline = _load("vs_vllm_worker"), _load("offline_throughput")
    for seed in (0, 3):
        assert worker.mixed_workload(_Tok(), 64, seed) == offline.make_workload(_Tok(), 64, seed)


def test_table_ratios(capsys):
    vs = _load("vs_vllm")
    def res(mixed, b1):
        return {"offline": {"mixed": {"total_tok_s": mixed, "load1": 1.0},
                            "b1": {"decode_ms_per_token": b1, "load1": 1.0}}}
    vs.print_table({"formwork": res(150.0, 20.0), "vllm": res(100.0, 30.0)}, ["formwork", "vllm"])
    out = capsys.readouterr().out
    assert "| mixed: 64 requests, total tok/s | 150.0 | 100.0 | **1.50** |" in out
    assert "| 20.0 | 30.0 | **1.50** (vLLM ms ÷ formwork ms) |" in out      # lower is better
