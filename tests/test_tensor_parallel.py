"""Tensor parallelism (gpu/tensor_parallel.py, gpu/tp_worker.py): the shards put
back together are the model; TP=2 on a tiny random model gives TP=1's logits
(fp32, close) and greedy tokens; the real model gives TP=1's greedy tokens at
TP=3 token for token, structured outputs included; a size that does not divide
the heads is refused naming tensor_parallel_size; workers are gone after
shutdown; TP works through the engine process."""
import dataclasses
import json
import multiprocessing

import jsonschema
import psutil
import pytest
import torch

from formwork import LLM, SamplingParams, StructuredOutputsParams as SO
from formwork.gpu.executor import Executor
from formwork.gpu.model import ModelConfig
from formwork.gpu.tensor_parallel import shard_config, shard_hf_weights
from formwork.schemas.config import EngineConfig
from formwork.schemas.scheduler import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=64)


def _tiny_config(tiny_model_dir, tp: int) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32, block_size=16,
                        max_num_batched_tokens=256, max_num_seqs=4, tensor_parallel_size=tp,
                        num_threads=1)


def test_shards_put_back_together_are_the_weights(tiny_model_dir):
    from safetensors.torch import load_file
    cfg = ModelConfig.from_dir(tiny_model_dir)
    full = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    shards = [shard_hf_weights(full, cfg, r, 2) for r in range(2)]
    p = "model.layers.1."
    for name, dim in [("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("mlp.up_proj", 0),
                      ("self_attn.o_proj", 1), ("mlp.down_proj", 1)]:
        key = f"{p}{name}.weight"
        assert torch.equal(torch.cat([s[key] for s in shards], dim), full[key])
        assert shards[0][key].shape[dim] * 2 == full[key].shape[dim]
    assert torch.equal(shards[1]["model.embed_tokens.weight"], full["model.embed_tokens.weight"])
    rank_cfg = shard_config(cfg, 2)
    assert (rank_cfg.num_attention_heads, rank_cfg.num_key_value_heads, rank_cfg.intermediate_size,
            rank_cfg.head_dim, rank_cfg.hidden_size) == (2, 1, 64, 16, 64)


def test_indivisible_size_is_refused_before_any_worker_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide.*num_attention_heads"):
        Executor(_tiny_config(tiny_model_dir, 3), tiny_model_dir)
    assert not multiprocessing.active_children()
    cfg = ModelConfig.from_dir(tiny_model_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide.*num_key_value_heads"):
        shard_config(cfg, 4)


def _plans(prompt: list[int], steps: int):
    """Yields the plans of one greedy request: the prefill, then `steps` decodes;
    send() the token sampled at each."""
    rid, blocks = "r", [0, 1, 2]
    token = yield SchedulerOutput(
        new_reqs=[NewRequestData(rid, prompt, GREEDY, blocks, 0)], cached_reqs=[],
        num_scheduled_tokens={rid: len(prompt)}, total_num_scheduled_tokens=len(prompt),
        finished_req_ids=set(), sampling_req_ids=[rid])
    n = len(prompt)
    for _ in range(steps):
        token = yield SchedulerOutput(
            new_reqs=[], cached_reqs=[CachedRequestData(rid, [], n, [token])],
            num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1,
            finished_req_ids=set(), sampling_req_ids=[rid])
        n += 1


def _run_executor(ex: Executor, prompt: list[int], steps: int):
    logits, tokens = [], []
    gen = _plans(prompt, steps)
    plan = next(gen)
    while True:
        logits.append(ex.execute_model(plan).result())
        tokens.append(ex.sample_tokens(None).sampled_token_ids[0])
        try:
            plan = gen.send(tokens[-1])
        except StopIteration:
            return torch.stack(logits), tokens


@pytest.mark.slow
def test_tp2_tiny_model_matches_tp1_and_workers_exit(tiny_model_dir):
    prompt = [1, 450, 7042, 310, 3444, 338, 263, 4086, 4086, 17, 93, 1200, 5, 77, 901, 12, 13, 14]
    one = Executor(_tiny_config(tiny_model_dir, 1), tiny_model_dir)
    try:
        ref_logits, ref_tokens = _run_executor(one, prompt, 12)
    finally:
        one.shutdown()
    two = Executor(_tiny_config(tiny_model_dir, 2), tiny_model_dir)
    workers = list(two._workers)
    try:
        assert len(workers) == 1 and workers[0].is_alive()
        assert two.runner.kv_caches[0][0].shape == (32, 16, 1, 16)   # rank 0 holds 1 of 2 KV heads
        logits, tokens = _run_executor(two, prompt, 12)
    finally:
        two.shutdown()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens == ref_tokens
    for p in workers:
        assert not p.is_alive() and p.exitcode == 0
    assert not multiprocessing.active_children()


PROMPTS = [
    "The capital of France is",
    "List three prime numbers greater than ten, separated by commas:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _generate(llm: LLM) -> list[list[int]]:
    plain = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate(PROMPTS, plain, use_tqdm=False)
    chat = [{"role": "user", "content": "Give a person as JSON with a name and an age."}]
    structured = SamplingParams(temperature=0, max_tokens=48, structured_outputs=SO(json=SCHEMA))
    out = llm.chat([chat], structured, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
    return [o.outputs[0].token_ids for o in outs] + [out.token_ids]


@pytest.mark.slow
def test_real_model_tp3_greedy_tokens_equal_tp1(default_model_dir):
    kw = dict(engine_process=False, dtype="float32", num_kv_blocks=64, max_num_seqs=4, num_threads=1)
    llm = LLM(**kw)
    try:
        ref = _generate(llm)
    finally:
        llm.shutdown()
    llm = LLM(tensor_parallel_size=3, **kw)
    workers = list(llm.engine.executor._workers)
    try:
        assert len(workers) == 2
        got = _generate(llm)
    finally:
        llm.shutdown()
    assert got == ref
    assert all(not p.is_alive() and p.exitcode == 0 for p in workers)


@pytest.mark.slow
def test_tp2_through_the_engine_process(tiny_model_dir):
    prompts = [{"prompt_token_ids": [1, 450, 7042, 310, 3444, 338]},
               {"prompt_token_ids": [5, 77, 901, 12, 13, 14, 15, 16, 17]}]
    sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    cfg = dict(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_num_seqs=4,
               num_threads=1)
    llm = LLM(engine_process=False, **cfg)
    try:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.shutdown()
    llm = LLM(tensor_parallel_size=2, **cfg)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        children = psutil.Process(llm.engine._proc.pid).children()   # the TP worker, maybe helpers
        cmdlines = [" ".join(c.cmdline()) for c in children]
    finally:
        llm.shutdown()
    assert got == ref
    assert any("spawn_main" in c for c in cmdlines), cmdlines
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


@pytest.mark.slow
def test_tp2_bf16_keeps_the_cpu_fast_paths_per_shard(tiny_model_dir):
    from formwork.gpu.cpu_linear import PackedLinear, packing_supported
    from formwork.gpu.model import CPU_FUSED_OPS
    from formwork.kernels import cpu_fused_ops
    if not packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no packed bf16 linears on this CPU")
    prompt = [1, 450, 7042, 310, 3444, 338, 263, 4086, 17, 93]
    configs = [dataclasses.replace(_tiny_config(tiny_model_dir, tp), dtype="bfloat16") for tp in (1, 2)]
    results = []
    for config in configs:
        ex = Executor(config, tiny_model_dir)
        try:
            layer = ex.runner.model.model.layers[0]
            if config.tensor_parallel_size == 2:
                assert type(layer.self_attn.o_proj.linear) is PackedLinear
                assert type(layer.mlp.down_proj.linear) is PackedLinear
            assert type(layer.self_attn.qkv_proj) is PackedLinear
            if cpu_fused_ops.available():
                assert ex.runner.model.ops is CPU_FUSED_OPS
            results.append(_run_executor(ex, prompt, 6)[0])
        finally:
            ex.shutdown()
    torch.testing.assert_close(results[1], results[0], atol=0.05, rtol=0.05)


def test_a_dead_worker_fails_the_step_naming_it_and_shutdown_still_returns(tiny_model_dir):
    ex = Executor(_tiny_config(tiny_model_dir, 2), tiny_model_dir)
    try:
        worker = ex._workers[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="tensor-parallel worker TPWorker-1 .* exited"):
            _run_executor(ex, [1, 2, 3], 1)
    finally:
        ex.shutdown()
    assert not multiprocessing.active_children()


def _plans_of_every_size() -> list:
    big = list(range(12000))             # msgpack > the one-broadcast buffer
    return [next(_plans([1, 2, 3], 0)), next(_plans(big, 0)), None]


def _broadcast_rank(rank: int, init_method: str, started) -> None:
    import datetime
    import time
    from formwork.gpu.tensor_parallel import TPGroup
    # both ranks imported: the 1 s timeout below covers the rendezvous too, and a
    # spawned process takes seconds to start on a busy box
    started.wait(120)
    tp = TPGroup.init(rank, 2, init_method, torch.device("cpu"), timeout=datetime.timedelta(seconds=1))
    try:
        for plan in _plans_of_every_size():
            if plan is None and rank == 0:
                time.sleep(2.5)          # an idle engine: longer than a step may take
            got = tp.broadcast_plan(plan if rank == 0 else None)
            assert got == plan, (rank, plan)
    finally:
        tp.destroy()


@pytest.mark.slow
def test_plans_cross_intact_small_large_and_stop_after_idling():
    from formwork.gpu.tensor_parallel import free_port
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    started = ctx.Barrier(2)
    procs = [ctx.Process(target=_broadcast_rank, args=(r, init_method, started)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
