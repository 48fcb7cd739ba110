"""Tensor parallelism inside a Ray engine actor: the engine's bundle reserves
`tensor_parallel_size` CPUs on one node and its TP workers are its own local
processes there (packed by construction). A one-node Ray cluster on 127.0.0.1
with 2 CPUs; the greedy tokens equal the in-process TP=1 engine's (fp32)."""
from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # Ray's "this node" is 127.0.0.1

import pytest  # noqa: E402

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow


def test_tp2_engine_as_a_ray_actor_matches_tp1(tiny_model_dir):
    from ray.util import placement_group_table

    from formwork import LLM, SamplingParams

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        kw = dict(dtype="float32", kv_cache_memory_gb=0.05, num_threads=1, max_model_len=128)
        prompts = [f"Row {i}: the total is" for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        local = LLM(str(tiny_model_dir), engine_process=False, **kw)
        want = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
        local.shutdown()
        llm = LLM(str(tiny_model_dir), distributed_executor_backend="ray",
                  tensor_parallel_size=2, **kw)
        try:
            assert llm.engine._proc.wait_placed(60)
            (group,) = [pg for pg in placement_group_table().values() if pg["state"] == "CREATED"]
            assert group["bundles"] == {0: {"CPU": 2.0}}       # the engine's ranks on one node
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
        assert got == want
    finally:
        ray.shutdown()
        cluster.shutdown()
