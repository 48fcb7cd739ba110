"""The offline LLM's default: the EngineCore in its own process (as vLLM V1),
started with the engine's own OpenMP settings, surviving nothing silently."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import json

import msgspec
import pytest

from formwork import LLM, SamplingParams, StructuredOutputsParams
from formwork.gateway.engine_process import EngineDiedError
from formwork.schemas.engine import EngineCoreRequest

GREEDY = dict(temperature=0, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(100 + 5 * i, 130 + 5 * i))} for i in range(n)]


def test_engine_process_equals_in_process_and_is_another_process(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    sp = [SamplingParams(max_tokens=12 + i, **GREEDY) for i in range(5)]
    inproc = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in inproc.generate(prompts(5), sp, use_tqdm=False)]
    inproc.shutdown()
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)     # the default
    try:
        assert llm.engine.info.pid != os.getpid()
        assert llm.engine.info.gomp_spincount == ""             # libgomp's default spin
        assert llm.get_stats().forward_threads >= 1             # the CPU team is governed
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(5), sp, use_tqdm=False)]
        assert got == want
        # an early abort (a failing callback) leaves the engine idle, blocks freed
        with pytest.raises(RuntimeError, match="stop here"):
            llm.generate(prompts(4), SamplingParams(max_tokens=200, **GREEDY), use_tqdm=False,
                         on_finished=lambda i, o: (_ for _ in ()).throw(RuntimeError("stop here")))
        stats = llm.get_stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_free_blocks == stats.kv_total_blocks
        again = [o.outputs[0].token_ids for o in llm.generate(prompts(5), sp, use_tqdm=False)]
        assert again == want
        # a utility call through the process: the cached prompts are forgotten
        assert llm.get_stats().kv_cached_blocks > 0
        assert llm.reset_prefix_cache() is True
        assert llm.get_stats().kv_cached_blocks == 0
        assert llm.generate(prompts(1), sp[:1], use_tqdm=False)[0].num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_user_setting_wins(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, adaptive_threads=False)
    try:
        assert llm.engine.info.gomp_spincount == "1000"
        assert llm.get_stats().forward_threads == 0
    finally:
        llm.shutdown()


def test_a_dead_engine_fails_the_call_instead_of_hanging(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    os.kill(llm.engine.info.pid, signal.SIGKILL)
    with pytest.raises(EngineDiedError, match="engine process exited"):
        llm.generate(prompts(2), SamplingParams(max_tokens=50, **GREEDY), use_tqdm=False)
    llm.shutdown()


def test_a_request_the_engine_cannot_read_never_kills_it(tiny_model_dir):
    """msgspec checks types when it decodes, not when a struct is built: a value of
    the wrong type set from Python used to reach the engine, whose decoder raised
    and took the process down (the server's `"schema": true` did, and its replay
    of the same request killed the restarted engine too). Now the sender refuses it
    naming the field, and a frame the engine still cannot read fails its request
    alone."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    try:
        pid = llm.engine.info.pid
        # the schema `true` is any JSON value, as `{}`
        out = llm.generate(prompts(1), SamplingParams(
            max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(json=True)),
            use_tqdm=False)[0].outputs[0]
        if out.finish_reason == "stop":
            json.loads(out.text)
        sp = SamplingParams(max_tokens=4, **GREEDY)
        bad = sp.clone(structured_outputs=StructuredOutputsParams(json={}))
        bad.structured_outputs.json = 5
        with pytest.raises(ValueError, match="structured_outputs.json") as e:
            llm.generate(prompts(3), [sp, bad, sp], use_tqdm=False)
        assert e.value.param == "structured_outputs.json"
        with pytest.raises(ValueError) as e:
            llm.generate([{"prompt_token_ids": [100, 101.5]}], sp, use_tqdm=False)
        assert e.value.param == "prompt"
        # a frame past the sender's check: its request fails alone, the engine serves on
        raw = msgspec.to_builtins(EngineCoreRequest(request_id="unreadable",
                                                    prompt_token_ids=[1, 2], sampling_params=sp))
        raw["prompt_token_ids"] = "not a list"
        llm.engine._in.send(msgspec.msgpack.encode(raw))
        seen = []
        while not any(o.request_id == "unreadable" for o in seen) and len(seen) < 50:
            seen += llm.engine._recv().outputs       # earlier aborts' outputs may come first
        (failed,) = [o for o in seen if o.request_id == "unreadable"]
        assert failed.finish_reason == "error" and failed.new_token_ids == []
        assert "could not read this request" in failed.error
        llm.engine._in.send(b"\xc1 not msgpack")           # no request to name: dropped
        got = llm.generate(prompts(2), sp, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in got] == [4, 4]
        assert llm.engine.info.pid == pid and llm.engine._proc.is_alive()
        stats = llm.get_stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_free_blocks == stats.kv_total_blocks
    finally:
        llm.shutdown()


def test_env_switch_keeps_the_engine_in_process(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FORMWORK_ENGINE_PROCESS", "0")
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    try:
        assert llm.engine.kv_manager is not None       # the EngineCore itself
    finally:
        llm.shutdown()
    monkeypatch.setenv("FORMWORK_ENGINE_PROCESS", "maybe")
    with pytest.raises(ValueError, match="FORMWORK_ENGINE_PROCESS"):
        LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)


def test_a_script_without_main_guard_can_use_llm(tiny_model_dir, tmp_path):
    """The engine process is spawned without re-running the caller's script (which
    would start engines recursively), so top-level `LLM()` in a script works."""
    out = run_script(tmp_path, (
        "from formwork import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, dtype='float32', num_kv_blocks=32)\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=4, "
        "temperature=0, ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n"
        "print('RAN', __name__)\n"), timeout=300)
    assert out.splitlines() == ["TOKENS 4", "RAN __main__"]


def run_script(tmp_path, text: str, timeout: float) -> str:
    """Run `text` as a script in a fresh interpreter; its stdout (it must exit 0)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    run = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True,
                         timeout=timeout, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_a_script_whose_llm_sits_in_a_reference_cycle_exits(tiny_model_dir, tmp_path):
    """An `LLM` reachable only through a reference cycle is collected in the
    interpreter's final garbage collection; the engine's cleanup used to run there
    (`__del__`) and block for ever in zmq's Context.term. The script must exit at
    once, its engine process ended and its IPC folder removed."""
    out = run_script(tmp_path, (
        "from formwork import LLM, SamplingParams\n"
        "class Holder: pass\n"
        "h = Holder(); h.me = h\n"
        f"h.llm = LLM({str(tiny_model_dir)!r}, dtype='float32', num_kv_blocks=32)\n"
        "out = h.llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=3, "
        "temperature=0, ignore_eos=True), use_tqdm=False)\n"
        "print('ENGINE', h.llm.engine.info.pid)\n"
        "print('IPC', h.llm.engine._tmpdir)\n"
        "print('TOKENS', len(out[0].outputs[0].token_ids))\n"
        "del h\n"), timeout=120)
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["TOKENS"] == "3"
    with pytest.raises(ProcessLookupError):
        os.kill(int(lines["ENGINE"]), 0)
    assert not os.path.exists(lines["IPC"])


def test_stale_ipc_dirs_of_dead_processes_are_removed(tmp_path):
    """A SIGKILLed server leaves its ipc folder behind; the next start removes
    folders whose process is gone, never a live process's or another name."""
    from formwork.core.ipc import IPC_PREFIX, remove_stale_ipc_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{IPC_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{IPC_PREFIX}{os.getpid()}-def"
    other = tmp_path / "formwork-something-else"
    for d in (stale, live, other):
        d.mkdir()
        (d / "input").write_text("")
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
