"""The data-parallel server run of tests/test_data_parallel_server.py through the
Ray backend: `formwork serve --data-parallel-size 2 --distributed-executor-backend
ray` on a two-node Ray cluster simulated on this machine (loopback only), the
engines on distinct nodes. The same tests run against this module's server."""
from __future__ import annotations

import os
import signal

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # Ray's "this node" is 127.0.0.1

import pytest  # noqa: E402

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from test_data_parallel_server import (health,  # noqa: E402,F401 - collected here too
                                       test_killed_engine_fails_only_its_requests_and_comes_back,
                                       test_mixed_run_every_request_answered_once_on_both_engines)
from test_server import Server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    os.environ["RAY_ADDRESS"] = cluster.address            # the server joins this cluster
    try:
        s = Server("--data-parallel-size", "2", "--distributed-executor-backend", "ray",
                   "--kv-cache-memory-gb", "0.25", "--max-model-len", "512",
                   "--max-num-seqs", "16", "--dtype", "float32")
        try:
            yield s
        finally:
            assert s.stop(signal.SIGTERM) == 0, s.logs()
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.shutdown()


def test_engines_run_as_ray_actors_on_distinct_nodes(server):
    h = health(server)
    nodes = [e.get("node") for e in h["engines"]]
    assert None not in nodes and len(set(nodes)) == 2, h
    gateway_children = {p.pid for p in __import__("psutil").Process(server.proc.pid).children(recursive=True)}
    assert not {e["pid"] for e in h["engines"]} & gateway_children   # Ray's workers, not ours
