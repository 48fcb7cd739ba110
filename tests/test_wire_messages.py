"""The gateway <-> EngineCore messages are typed on the wire (schemas/engine.py):
the input socket decodes one tagged union and refuses anything else; utility
answers, the stats and the ready handshake come back as their structs, and a
wrong or failed answer is an error, never a dict read by key."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from formwork.core.engine_proc import READY_CALL_ID, EngineLoop, handshake_result, utility_value
from formwork.gateway.dp_router import sum_stats
from formwork.gateway.engine_channel import EngineChannel
from formwork.gateway.errors import EngineDeadError
from formwork.schemas.engine import (UTILITY_RESULTS, EngineCoreAbort, EngineCoreOutputs,
                                     EngineCoreRequest, EngineCoreUtility, EngineInfo,
                                     EngineShutdown, EngineStats, InputMessage, Pong, Reset,
                                     UtilityError)
from formwork.schemas.sampling import SamplingParams

ENC = msgspec.msgpack.Encoder()
INPUT = msgspec.msgpack.Decoder(InputMessage)
OUTPUT = msgspec.msgpack.Decoder(EngineCoreOutputs)

STATS = EngineStats(num_running=2, num_waiting=1, num_waiting_for_grammar=0, kv_total_blocks=64,
                    kv_free_blocks=60, kv_cached_blocks=3, prefix_cache_queries=10,
                    prefix_cache_hits=4, num_preemptions=0, grammar_compile_seconds=2.0,
                    bitmask_seconds=0.25, steps=7, forward_threads=3)
INFO = EngineInfo(max_model_len=512, vocab_size=49152, num_kv_blocks=64, block_size=16,
                  device="cpu", dtype="float32", attention_backend="torch",
                  cuda_graph_sizes=(1, 2, 4), structured_backend="auto", load_seconds=1.5,
                  pid=1234, gomp_spincount="300000")


@pytest.mark.parametrize("msg", [
    EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(
        max_tokens=3, temperature=0.0)),
    EngineCoreAbort(request_ids=["a", "b"]),
    EngineCoreUtility(call_id=3, method="get_stats"),
    EngineShutdown(),
])
def test_each_input_kind_decodes_as_itself(msg):
    got = INPUT.decode(ENC.encode(msg))
    assert type(got) is type(msg) and got == msg


@pytest.mark.parametrize("raw", [
    {"request_ids": ["a"]},                                   # untagged
    {"type": "pause", "request_ids": ["a"]},                  # unknown tag
    {"abort": {"request_ids": ["a"]}, "shutdown": False},     # the old struct of optionals
    {"type": "abort"},                                        # tag without its fields
    {"type": "utility", "call_id": "3", "method": "ping"},    # a field of the wrong type
])
def test_the_input_decoder_refuses_what_is_not_one_kind(raw):
    with pytest.raises(msgspec.ValidationError):
        INPUT.decode(ENC.encode(raw))


def test_stats_and_info_round_trip_with_their_types():
    for result in (STATS, INFO, Pong(), UtilityError(message="boom")):
        outs = OUTPUT.decode(ENC.encode(EngineCoreOutputs(utility_call_id=5, utility_result=result)))
        assert type(outs.utility_result) is type(result) and outs.utility_result == result
    got = OUTPUT.decode(ENC.encode(EngineCoreOutputs(utility_call_id=5, utility_result=STATS)))
    s = got.utility_result
    assert isinstance(s.grammar_compile_seconds, float) and isinstance(s.kv_free_blocks, int)
    info = OUTPUT.decode(ENC.encode(EngineCoreOutputs(utility_call_id=0, utility_result=INFO)))
    assert info.utility_result.cuda_graph_sizes == (1, 2, 4)
    plain = OUTPUT.decode(ENC.encode(EngineCoreOutputs(outputs=[])))
    assert plain.utility_call_id is None and plain.utility_result is None
    total = sum_stats([STATS, None, STATS])
    assert type(total) is EngineStats and total.bitmask_seconds == 0.5 and total.steps == 14


def test_stats_of_the_wrong_type_do_not_decode():
    raw = msgspec.to_builtins(STATS) | {"kv_free_blocks": 1.5}
    with pytest.raises(msgspec.ValidationError):
        OUTPUT.decode(ENC.encode({"utility_call_id": 1, "utility_result": raw, "outputs": []}))
    with pytest.raises(msgspec.ValidationError):            # an untagged dict is no result
        OUTPUT.decode(ENC.encode({"utility_call_id": 1, "utility_result": {"ok": True}}))


def test_handshake_is_engine_info_or_a_start_error():
    assert handshake_result(EngineCoreOutputs(utility_call_id=READY_CALL_ID,
                                              utility_result=INFO)) == INFO
    assert handshake_result(EngineCoreOutputs(outputs=[])) is None          # a late output
    assert handshake_result(EngineCoreOutputs(utility_call_id=4, utility_result=INFO)) is None
    with pytest.raises(RuntimeError, match="failed to start: OSError: no model"):
        handshake_result(EngineCoreOutputs(utility_call_id=READY_CALL_ID,
                                           utility_result=UtilityError(message="OSError: no model")))
    with pytest.raises(RuntimeError, match="EngineStats, not EngineInfo"):
        handshake_result(EngineCoreOutputs(utility_call_id=READY_CALL_ID, utility_result=STATS))


def test_utility_value_checks_the_method_s_struct():
    assert set(UTILITY_RESULTS) == {"ping", "get_stats", "info", "reset_prefix_cache"}
    assert utility_value("get_stats", STATS) is STATS
    assert utility_value("reset_prefix_cache", Reset(done=False)) == Reset(done=False)
    assert utility_value("ping", Pong()) == Pong()
    with pytest.raises(RuntimeError, match="'get_stats' answered EngineInfo"):
        utility_value("get_stats", INFO)
    with pytest.raises(RuntimeError, match="'info' failed: KeyError"):
        utility_value("info", UtilityError(message="KeyError: x"))
    with pytest.raises(RuntimeError, match="'nope' answered Pong"):
        utility_value("nope", Pong())


class _Core:
    def get_stats(self) -> EngineStats:
        return STATS

    def reset_prefix_cache(self) -> bool:
        return True


class _Broken:
    def get_stats(self) -> EngineStats:
        raise KeyError("kv")


def _loop_answers(core, *msgs):
    """What the engine loop publishes for `msgs` (decoded as the gateway does)."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://answers")
    push.connect("inproc://answers")
    try:
        loop = EngineLoop(core, ctx.socket(zmq.PULL), push, parent_pid=None)
        for msg in msgs:
            loop._handle(INPUT.decode(ENC.encode(msg)))
        answers = []
        while pull.poll(100):
            answers.append(OUTPUT.decode(pull.recv()))
        return loop, answers
    finally:
        ctx.destroy(linger=0)


def test_the_engine_loop_answers_each_method_with_its_struct():
    loop, answers = _loop_answers(_Core(), EngineCoreUtility(call_id=1, method="ping"),
                                  EngineCoreUtility(call_id=2, method="get_stats"),
                                  EngineCoreUtility(call_id=3, method="explode"),
                                  EngineCoreUtility(call_id=4, method="reset_prefix_cache"),
                                  EngineShutdown())
    assert [a.utility_call_id for a in answers] == [1, 2, 3, 4]
    assert answers[0].utility_result == Pong()
    assert answers[1].utility_result == STATS
    assert answers[3].utility_result == Reset(done=True)
    err = answers[2].utility_result
    assert isinstance(err, UtilityError) and "'explode'" in err.message and "get_stats" in err.message
    assert not loop.running                                     # the shutdown message
    _, (broken,) = _loop_answers(_Broken(), EngineCoreUtility(call_id=9, method="get_stats"))
    assert broken.utility_result == UtilityError(message="KeyError: 'kv'")


def test_the_channel_resolves_typed_calls_and_fails_them_when_the_engine_dies():
    async def main():
        channel = EngineChannel(None)
        in_addr, out_addr = channel.bind()
        ctx = zmq.asyncio.Context()
        engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        engine_in.connect(in_addr)
        engine_out.connect(out_addr)

        async def fake_engine(result):
            call = INPUT.decode(await engine_in.recv())
            assert isinstance(call, EngineCoreUtility)
            await engine_out.send(ENC.encode(EngineCoreOutputs(utility_call_id=call.call_id,
                                                               utility_result=result)))
            outs = await channel.recv()
            assert channel.answer(outs)

        try:
            alive = lambda: False                                   # noqa: E731
            got, _ = await asyncio.gather(channel.call("get_stats", 5.0, alive), fake_engine(STATS))
            assert got == STATS
            with pytest.raises(RuntimeError, match="'ping' answered EngineStats"):
                await asyncio.gather(channel.call("ping", 5.0, alive), fake_engine(STATS))
            assert not channel.answer(EngineCoreOutputs(outputs=[]))
            waiting = asyncio.ensure_future(channel.call("info", 5.0, alive))
            await engine_in.recv()
            channel.fail_calls(EngineDeadError)
            with pytest.raises(EngineDeadError):
                await waiting
        finally:
            ctx.destroy(linger=0)
            channel.close()
    asyncio.run(main())
