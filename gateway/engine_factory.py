"""Which engine client a server runs, from the config: one EngineClient, or a
DPEngineClient over `data_parallel_size` engines; their engines local
processes (`--distributed-executor-backend mp`, ipc sockets) or Ray actors
(`ray`, TCP sockets bound on this node's address, core/ray_engines.py).

Returns the client and the function that releases what the backend holds
(Ray's placement group) once the client has shut down.
"""
from __future__ import annotations

import logging
from typing import Callable

from formwork.gateway.dp_client import DPEngineClient
from formwork.gateway.engine_client import EngineClient
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.gateway")


def make_engine_client(config: EngineConfig, *, on_fatal: Callable[[], None] | None = None
                       ) -> tuple[EngineClient | DPEngineClient, Callable[[], None]]:
    launcher, bind_host, release = None, None, (lambda: None)
    if config.distributed_executor_backend == "ray":
        # Ray is the optional `ray` extra: imported only when asked for
        from formwork.core import ray_engines

        placement = ray_engines.RayEngineLauncher(config, config.data_parallel_size)
        launcher, bind_host, release = placement.launch, ray_engines.gateway_host(), placement.shutdown
        log.info("Ray backend: %d engine bundle(s) placed; engines reach this gateway at %s",
                 config.data_parallel_size, bind_host)
    if config.data_parallel_size == 1:
        client = EngineClient(config, on_fatal=on_fatal, launcher=launcher, bind_host=bind_host)
    else:
        client = DPEngineClient(config, on_fatal=on_fatal, launcher=launcher, bind_host=bind_host)
    return client, release
