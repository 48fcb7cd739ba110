"""Engines as Ray actors (core/ray_engines.py) on a two-node Ray cluster simulated
on this machine, every node bound to the loopback address.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes Ray resolve "this node" to
127.0.0.1 instead of the host's interface address (ray._private.services
.get_node_ip_address); it is read when Ray is imported, so it is set first.
"""
from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import time  # noqa: E402

import msgspec  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402

ray = pytest.importorskip("ray")   # the test extra installs it; CI always has it

from ray.cluster_utils import Cluster  # noqa: E402

from formwork.core import ray_engines  # noqa: E402
from formwork.core.engine_proc import handshake_result  # noqa: E402
from formwork.schemas.config import EngineConfig  # noqa: E402
from formwork.schemas.engine import EngineCoreOutputs, EngineCoreRequest  # noqa: E402
from formwork.schemas.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses the given processes listen on (TCP)."""
    out = set()
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.add(c.laddr.ip)
    return out


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two Ray nodes (one CPU each, distinct node ids) on 127.0.0.1; the driver joins."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_nodes_bind_to_loopback_only(two_node_cluster):
    nodes = ray.nodes()
    assert len(nodes) == 2 and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    ray_pids = {p.pid for p in psutil.process_iter(["cmdline"])
                if any("ray" in part for part in (p.info["cmdline"] or [])[:2])}
    addrs = listening_addresses(ray_pids)
    assert addrs, "found no listening Ray process"
    assert addrs <= {"127.0.0.1", "::ffff:127.0.0.1"}, addrs
    assert ray_engines.gateway_host() == "127.0.0.1"


def _bind(ctx, kind) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(kind)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _recv(sock, decoder, timeout_s: float) -> EngineCoreOutputs:
    assert sock.poll(int(timeout_s * 1000)), "no engine output in time"
    return decoder.decode(sock.recv())


def test_engines_spread_over_nodes_serve_and_come_back_after_a_kill(two_node_cluster, default_model_dir):
    """Two engine actors land on distinct nodes, each answers a greedy request over
    TCP with the same tokens; killing one (kill -9 of its pid) fires its handle's
    sentinel, and a relaunch in the same bundle serves again."""
    config = EngineConfig(kv_cache_memory_gb=0.1, num_threads=1, dtype="float32",
                          data_parallel_size=2)
    launcher = ray_engines.RayEngineLauncher(config, 2, ready_timeout_s=60)
    ctx = zmq.Context()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    engines = []
    try:
        for i in range(2):
            push, in_addr = _bind(ctx, zmq.PUSH)
            pull, out_addr = _bind(ctx, zmq.PULL)
            handle = launcher.for_engine(i)(config, in_addr, out_addr)
            engines.append((push, pull, handle, in_addr, out_addr))
        assert all(h.wait_placed(60) for _, _, h, _, _ in engines)
        assert len({h.node_id for _, _, h, _, _ in engines}) == 2, "engines share a node"
        for push, pull, handle, _, _ in engines:
            info = handshake_result(_recv(pull, dec, 120))
            assert info is not None and info.pid == handle.pid

        def greedy(push, pull, rid) -> list[int]:
            push.send(enc.encode(EngineCoreRequest(
                request_id=rid, prompt_token_ids=[1, 504, 3458, 314, 260],
                sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))))
            tokens: list[int] = []
            while True:
                for o in _recv(pull, dec, 60).outputs:
                    assert o.request_id == rid and o.error is None, o
                    tokens += o.new_token_ids
                    if o.finish_reason is not None:
                        return tokens

        first = [greedy(push, pull, f"r{i}") for i, (push, pull, *_rest) in enumerate(engines)]
        assert len(first[0]) == 6 and first[0] == first[1]

        push, pull, handle, in_addr, out_addr = engines[1]
        os.kill(handle.pid, 9)
        deadline = time.monotonic() + 30
        readable = False
        while time.monotonic() < deadline and not readable:
            readable = bool(zmq.select([handle.sentinel], [], [], 0.5)[0])
        assert readable and not handle.is_alive() and handle.exitcode == 1

        again = launcher.launch(config, in_addr, out_addr)        # the free bundle: 1
        assert again.wait_placed(60)
        assert again.pid != handle.pid and again.node_id == handle.node_id   # its bundle
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:          # skip the dead engine's leftovers
            if handshake_result(_recv(pull, dec, 120)) is not None:
                break
        assert greedy(push, pull, "r-again") == first[0]
    finally:
        launcher.shutdown()
        ctx.destroy(linger=0)
    for _, _, h, _, _ in engines:
        h.join(30)
        assert not h.is_alive()


def test_no_room_is_a_clear_error(two_node_cluster):
    config = EngineConfig(tensor_parallel_size=4, data_parallel_size=1)
    with pytest.raises(RuntimeError, match="no room"):
        ray_engines.RayEngineLauncher(config, 1, ready_timeout_s=2)



def test_offline_llm_on_ray_engines_matches_one_local_engine(two_node_cluster, tiny_model_dir):
    """LLM(distributed_executor_backend="ray", data_parallel_size=2): the engines are
    Ray actors on both nodes, the outputs are the in-process engine's (fp32 greedy),
    and shutdown removes the placement group."""
    from ray.util import placement_group_table

    from formwork import LLM, SamplingParams

    kw = dict(dtype="float32", kv_cache_memory_gb=0.05, num_threads=1, max_model_len=128)
    prompts = [f"Item {i}: the value is" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    local = LLM(str(tiny_model_dir), engine_process=False, **kw)
    want = [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)]
    local.shutdown()
    llm = LLM(str(tiny_model_dir), distributed_executor_backend="ray", data_parallel_size=2, **kw)
    try:
        nodes = {e._proc.node_id for e in llm.engine.engines if e._proc.wait_placed(60)}
        assert len(nodes) == 2
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
