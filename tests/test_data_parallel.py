"""Data parallelism: the router's rule (least outstanding work, prefix affinity,
overload fallback, only ready engines, counters back to 0), DPEngineClient's
routing over fake engines (n > 1 on one engine, aborts reach the right
engine), an EngineClient over tcp:// with the default launcher, and the
offline LLM(data_parallel_size=2) giving the same greedy outputs as one engine.
The server end to end: tests/test_data_parallel_server.py."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from formwork.gateway.dp_router import OVERLOAD_SLACK, REQUEST_TOKENS, Router, sum_stats
from formwork.gateway.engine_launch import dp_engine_config, rank_devices
from formwork.gateway.errors import EngineDeadError
from formwork.gateway.output_processor import CompletionOutput, RequestOutput
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import EngineStats
from formwork.schemas.sampling import SamplingParams

BS = 16
BOTH = [True, True]


def prompt(first: int, length: int = 40) -> list[int]:
    """A prompt whose first block is told apart by `first`."""
    return [first] * BS + list(range(1000, 1000 + length - BS))


def start(r: Router, rid: str, ids: list[int], ready=BOTH, max_tokens: int = 10) -> tuple[int, str]:
    index, reason = r.route(ids, ready)
    r.started(rid, index, reason, len(ids), max_tokens)
    return index, reason


def test_least_loaded_engine_gets_a_new_prefix():
    r = Router(2, BS)
    assert start(r, "a", prompt(1)) == (0, "load")          # a tie: the lowest index
    assert start(r, "b", prompt(2)) == (1, "load")
    assert r.engines[0].tokens == 40 + 10 and r.engines[0].requests == 1
    assert start(r, "c", prompt(3), max_tokens=1000) == (0, "load")
    assert start(r, "d", prompt(4)) == (1, "load")          # 0 holds 1000 more tokens
    assert start(r, "e", [5] * (BS - 1)) == (1, "load")     # no full block: load only


def test_an_engine_whose_cache_was_emptied_holds_no_prefix():
    r = Router(2, BS)
    assert start(r, "a", prompt(1)) == (0, "load")
    assert start(r, "b", prompt(2)) == (1, "load")
    r.finished("a"), r.finished("b")
    r.forget_prefixes(0)
    assert start(r, "c", prompt(2)) == (1, "affinity")      # engine 1 still holds it
    r.finished("c")
    assert start(r, "d", prompt(1)) == (0, "load")          # a tie again, no affinity
    r.finished("d")
    r.forget_prefixes()
    assert not r._holders                                   # noqa: SLF001


def test_affinity_holds_until_the_home_is_overloaded():
    r = Router(2, BS)
    assert start(r, "a", prompt(7)) == (0, "load")          # the first block's home: 0
    assert start(r, "b", prompt(7)) == (0, "affinity")      # 0 is busier, still home
    i = 2
    while True:
        index, reason = start(r, f"r{i}", prompt(7), max_tokens=100)
        i += 1
        if index == 1:
            break
        assert reason == "affinity"
    assert reason == "load"
    # the rule in the docstring: home's load went past 1.5 x least + slack
    r.finished(f"r{i - 1}")                          # the one that went to 1
    assert r.engines[0].load() > OVERLOAD_SLACK and r.engines[1].load() == 0
    assert r.route(prompt(7), BOTH) == (1, "load")
    assert r.engines[0].routed == {"affinity": i - 2, "load": 1}     # b, r2 .. r(i-2); a


def test_a_prefix_every_engine_holds_routes_by_load_a_deeper_one_by_affinity():
    """Chat prompts share the template's system turn: once both engines served it,
    it no longer pulls traffic to one; a conversation's longer prefix still goes
    where it was served."""
    r = Router(2, BS)
    system = [3] * BS                                        # one shared block
    convo = system + [8] * BS + [9] * 5                      # a conversation of its own
    assert start(r, "a", system + [1] * BS, max_tokens=2000) == (0, "load")
    assert start(r, "b", convo) == (1, "load")               # 0 overloaded: both hold "system"
    assert start(r, "c", system + [2] * BS) == (1, "load")   # by load: 0 is still the busier
    r.finished("a")
    assert start(r, "d", system + [4] * BS) == (0, "load")   # by load again, not to a "home"
    assert start(r, "e", convo + [10] * BS) == (1, "affinity")   # its conversation's engine
    for rid in "bcde":
        r.finished(rid)
    assert r.route(convo, BOTH) == (1, "affinity")          # idle engines: affinity decides


def test_only_ready_engines_and_a_dead_home_moves():
    r = Router(3, BS)
    assert start(r, "a", prompt(1)) == (0, "load")
    assert start(r, "b", prompt(1), ready=[False, True, True]) == (1, "load")   # re-homed
    assert start(r, "c", prompt(1)) == (1, "affinity")
    assert r.route(prompt(9), [False, False, True]) == (2, "load")
    with pytest.raises(ValueError, match="no engine is ready"):
        r.route(prompt(1), [False, False, False])


def test_counters_go_back_to_zero():
    r = Router(2, BS)
    start(r, "a", prompt(1), max_tokens=20)
    r.started("n", 1, "load", 40, 20, n=3)
    assert r.engines[1].tokens == 40 + 3 * 20
    r.progressed("a", 5)
    assert r.engines[0].tokens == 40 + 15
    r.progressed("a", 50)                                  # past max_tokens: clamped at 0
    assert r.engines[0].tokens == 40
    with pytest.raises(ValueError, match="already in flight"):
        r.started("a", 1, "load", 1, 1)
    r.finished("a")
    r.finished("a")                                        # idempotent
    r.finished("n")
    assert [(e.requests, e.tokens) for e in r.engines] == [(0, 0), (0, 0)]
    assert r.engine_of("a") is None


def test_engine_reports_count_in_the_load():
    r = Router(2, BS)
    r.report(0, running=4, waiting=3, kv_usage=0.5)
    assert r.engines[0].load() == 3 * REQUEST_TOKENS + 512
    assert r.route(prompt(1), BOTH) == (1, "load")
    r.forget_reports(0)
    assert r.route(prompt(2), BOTH) == (0, "load")


def test_sum_stats_and_rank_devices():
    a = EngineStats(num_running=1, num_waiting=2, num_waiting_for_grammar=0, kv_total_blocks=10,
                    kv_free_blocks=5, kv_cached_blocks=1, prefix_cache_queries=3,
                    prefix_cache_hits=1, num_preemptions=0, grammar_compile_seconds=0.5)
    total = sum_stats([a, None, a])
    assert (total.num_running, total.kv_total_blocks, total.grammar_compile_seconds) == (2, 20, 1.0)
    assert sum_stats([None, None]) is None
    assert rank_devices(1, 2, "3,5") == "5"
    assert rank_devices(1, 2, "3") is None and rank_devices(0, 2, None) is None
    assert rank_devices(0, 1, "0,1") is None


def test_engines_sharing_gpus_split_the_memory_fraction(monkeypatch):
    config = EngineConfig(data_parallel_size=2, gpu_memory_utilization=0.8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    shared = dp_engine_config(config, 1)
    assert (shared.data_parallel_size, shared.gpu_memory_utilization) == (1, 0.4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    own = dp_engine_config(config, 1)
    assert (own.data_parallel_size, own.gpu_memory_utilization) == (1, 0.8)


# -- DPEngineClient over fake engines ---------------------------------------------------
class FakeEngine:
    """An EngineClient stand-in: yields `steps` outputs of one token per choice."""

    def __init__(self, steps: int = 3, fail: bool = False) -> None:
        self.state, self.dead, self.restarts, self.pid, self.info = "ready", False, 0, 1, {"x": 1}
        self.node = None                     # a local process, not a Ray actor
        self.steps, self.fail = steps, fail
        self.seen: list[tuple[str, int]] = []
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt, ids, params, replay=True):
        self.seen.append((request_id, params.n))
        for step in range(self.steps):
            await asyncio.sleep(0)
            if self.fail:
                raise EngineDeadError()
            outs = [CompletionOutput(index=i, text="", token_ids=[7] * (step + 1),
                                     delta_token_ids=[7],
                                     finish_reason="length" if step == self.steps - 1 else None)
                    for i in range(params.n)]
            yield RequestOutput(request_id, prompt, ids, outs, step == self.steps - 1)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def _dp(engines):
    from formwork.gateway.dp_client import DPEngineClient

    dp = DPEngineClient(EngineConfig(data_parallel_size=len(engines), block_size=BS))
    dp._real, dp.engines = dp.engines, engines            # the real ones only to shut down
    return dp


async def _drain(agen) -> list:
    async with contextlib.aclosing(agen) as gen:
        return [ro async for ro in gen]


def test_a_request_whose_engine_died_before_output_is_routed_again():
    """It was queued (nothing yielded) when its engine died: the other engine serves
    it; one that had yielded output gets the 503."""
    class DiesFirst(FakeEngine):
        async def generate(self, request_id, prompt, ids, params, replay=True):
            assert replay is False                        # the DP client re-routes itself
            self.seen.append((request_id, params.n))
            self.state = "restarting"                     # dead: not ready from now on
            e = EngineDeadError()
            e.after_send = e.before_output = True
            raise e
            yield                                         # an async generator

    async def main():
        e0, e1 = DiesFirst(), FakeEngine()
        dp = _dp([e0, e1])
        outs = await _drain(dp.generate("q", None, prompt(1), SamplingParams(max_tokens=3)))
        assert outs[-1].finished and e0.seen == [("q", 1)] and e1.seen == [("q", 1)]
        assert [(e.requests, e.tokens) for e in dp.router.engines] == [(0, 0), (0, 0)]
        e1.fail, e0.state = True, "restarting"             # a death after output: no retry
        with pytest.raises(EngineDeadError):
            await _drain(dp.generate("r", None, prompt(2), SamplingParams(max_tokens=3)))
        await asyncio.gather(*(e.shutdown() for e in dp._real))

    asyncio.run(main())


def test_dp_client_routes_counts_and_aborts():
    async def main():
        e0, e1 = FakeEngine(), FakeEngine()
        dp = _dp([e0, e1])
        sp = SamplingParams(max_tokens=3, n=2)
        outs = await _drain(dp.generate("a", None, prompt(1), sp))
        assert outs[-1].finished and e0.seen == [("a", 2)]          # n=2: one call, one engine
        # in flight: the counters hold it, abort reaches its engine, then back to 0
        gen = dp.generate("b", None, prompt(2), SamplingParams(max_tokens=3))
        await gen.__anext__()
        index = dp.router.engine_of("b")
        assert dp.router.engines[index].requests == 1
        await dp.abort("b")
        assert dp.engines[index].aborted == ["b"]
        await gen.aclose()
        # an engine that is not ready gets nothing; a failing engine's error passes through
        e0.state, e1.fail = "restarting", True
        with pytest.raises(EngineDeadError):
            await _drain(dp.generate("c", None, prompt(3), SamplingParams(max_tokens=3)))
        assert [rid for rid, _ in e1.seen][-1] == "c" and "c" not in [r for r, _ in e0.seen]
        assert dp.state == "ready" and [s["state"] for s in dp.engine_states()] == ["restarting", "ready"]
        e1.state = "failed"
        with pytest.raises(EngineDeadError):
            await _drain(dp.generate("d", None, prompt(4), SamplingParams(max_tokens=3)))
        assert dp.state == "restarting"
        assert [(e.requests, e.tokens) for e in dp.router.engines] == [(0, 0), (0, 0)]
        await asyncio.gather(*(e.shutdown() for e in dp._real))
    asyncio.run(main())


def test_dp_on_fatal_only_when_every_engine_failed():
    calls = []
    from formwork.gateway.dp_client import DPEngineClient

    dp = DPEngineClient(EngineConfig(data_parallel_size=2), on_fatal=lambda: calls.append(1))
    real = dp.engines
    dp.engines = [FakeEngine(), FakeEngine()]
    dp.engines[0].state = "failed"
    dp._on_engine_failed()
    assert calls == []
    dp.engines[1].state = "failed"
    dp._on_engine_failed()
    assert calls == [1] and dp.state == "failed"
    asyncio.run(_shutdown(real))


async def _shutdown(engines) -> None:
    await asyncio.gather(*(e.shutdown() for e in engines))


# -- real engines ---------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_client_over_tcp_with_the_default_launcher(tokenizer):
    """bind_host: the gateway binds tcp://127.0.0.1:<random> and the engine connects there."""
    from formwork.gateway.engine_client import EngineClient

    async def main():
        client = EngineClient(EngineConfig(kv_cache_memory_gb=0.25, max_model_len=512),
                              tokenizer, bind_host="127.0.0.1")
        try:
            info = await client.start()
            assert client._channel.in_addr.startswith("tcp://127.0.0.1:")
            assert client._channel.out_addr.startswith("tcp://127.0.0.1:")
            assert info.pid == client.pid
            ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
            outs = await _drain(client.generate("t", None, ids, SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True)))
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            assert await client.is_healthy()
        finally:
            await client.shutdown()
    asyncio.run(main())


@pytest.mark.slow
def test_offline_llm_data_parallel_equals_one_engine():
    from formwork import LLM

    prompts = [f"{i} apples and {i + 1} pears make" for i in range(6)]
    prompts += ["Write a haiku about the sea:", {"prompt_token_ids": list(range(200, 240))}]
    sp = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in prompts]
    sp[-2] = SamplingParams(max_tokens=5, temperature=0, n=2, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory_gb=0.25, max_model_len=256)
    one = LLM(**kw)
    try:
        want = [[c.token_ids for c in o.outputs] for o in one.generate(prompts, sp, use_tqdm=False)]
    finally:
        one.shutdown()
    two = LLM(data_parallel_size=2, **kw)
    try:
        assert len({e.info.pid for e in two.engine.engines}) == 2
        outs = two.generate(prompts, sp, use_tqdm=False)
        assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
        assert [[c.token_ids for c in o.outputs] for o in outs] == want
        routed = [sum(e.routed.values()) for e in two.engine.router.engines]
        assert all(n > 0 for n in routed), routed                 # both engines worked
        assert [(e.requests, e.tokens) for e in two.engine.router.engines] == [(0, 0), (0, 0)]
        stats = two.get_stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_free_blocks == stats.kv_total_blocks
        assert stats.kv_cached_blocks > 0
        assert two.reset_prefix_cache() is True             # every engine's
        assert two.get_stats().kv_cached_blocks == 0 and not two.engine.router._holders  # noqa: SLF001
    finally:
        two.shutdown()


@pytest.mark.slow
def test_one_engine_failing_for_good_leaves_the_other_serving(tiny_model_dir, tokenizer):
    """Real engines, a launcher whose restarts cannot load the model: engine 0 killed
    fails for good while engine 1 serves (no on_fatal); once engine 1 has failed
    too, on_fatal is called and requests get 503."""
    import dataclasses
    import os
    import signal

    from formwork.core.engine_proc import start_engine_process
    from formwork.gateway.dp_client import DPEngineClient

    launched: set[str] = set()

    def flaky(config, input_addr, output_addr):
        if input_addr in launched:                     # a restart: the model is "gone"
            config = dataclasses.replace(config, model=str(tiny_model_dir) + "-missing")
        launched.add(input_addr)
        return start_engine_process(config, input_addr, output_addr)

    async def wait_for(predicate, timeout_s: float = 60) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)

    async def main():
        fatal = []
        config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32,
                              max_model_len=128, data_parallel_size=2)
        dp = DPEngineClient(config, tokenizer, on_fatal=lambda: fatal.append(1), launcher=flaky,
                            max_restarts=1, restart_backoff_s=0.05)
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        try:
            await dp.start()
            os.kill(dp.engines[0].pid, signal.SIGKILL)
            await wait_for(lambda: dp.engines[0].state == "failed")
            assert fatal == [] and dp.state == "ready"
            for i in range(3):
                outs = await _drain(dp.generate(f"r{i}", None, prompt(i), sp))
                assert outs[-1].finished
            assert dp.router.engines[1].routed["load"] + dp.router.engines[1].routed["affinity"] == 3
            assert await dp.is_healthy()
            os.kill(dp.engines[1].pid, signal.SIGKILL)
            await wait_for(lambda: dp.engines[1].state == "failed")
            assert fatal == [1] and dp.state == "failed"
            with pytest.raises(EngineDeadError):
                await _drain(dp.generate("late", None, prompt(1), sp))
        finally:
            await dp.shutdown()
    asyncio.run(main())


def test_offline_data_parallel_needs_engine_processes():
    from formwork import LLM

    with pytest.raises(ValueError, match="engine_process"):
        LLM(data_parallel_size=2, engine_process=False)
