"""Which engine client a server runs (and which engine the offline LLM drives), from the config: one EngineClient, or a
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
from formwork.gateway.dp_offline import EngineProcessGroup
from formwork.gateway.engine_client import EngineClient
from formwork.gateway.engine_process import EngineProcess
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.gateway")


def engine_placement(config: EngineConfig) -> tuple[object | None, str | None, Callable[[], None]]:
    """(launcher, bind_host, release) for the config's executor backend: defaults
    (local processes, ipc sockets) for "mp"; Ray actors in a placement group,
    TCP sockets on this node's address, and the group's removal for "ray"."""
    if config.distributed_executor_backend != "ray":
        return None, None, (lambda: None)
    # Ray is the optional `ray` extra: imported only when asked for
    from formwork.core import ray_engines

    placement = ray_engines.RayEngineLauncher(config, config.data_parallel_size)
    host = ray_engines.gateway_host()
    log.info("Ray backend: %d engine bundle(s) placed; engines reach this process at %s",
             config.data_parallel_size, host)
    return placement.launch, host, placement.shutdown


def make_engine_client(config: EngineConfig, *, on_fatal: Callable[[], None] | None = None,
                       **client_kwargs) -> tuple[EngineClient | DPEngineClient, Callable[[], None]]:
    """The server's engine client and the function that releases the placement;
    `client_kwargs` (max_restarts, restart_backoff_s) go to each EngineClient."""
    launcher, bind_host, release = engine_placement(config)
    cls = EngineClient if config.data_parallel_size == 1 else DPEngineClient
    client = cls(config, on_fatal=on_fatal, launcher=launcher, bind_host=bind_host, **client_kwargs)
    return client, release


def make_engine_process(config: EngineConfig) -> tuple[object, Callable[[], None]]:
    """The offline LLM's engine (one EngineProcess, or an EngineProcessGroup under
    data parallelism) and the function that releases the placement."""
    launcher, bind_host, release = engine_placement(config)
    try:
        if config.data_parallel_size > 1:
            return EngineProcessGroup(config, launcher=launcher, bind_host=bind_host), release
        return EngineProcess(config, launcher=launcher, bind_host=bind_host), release
    except BaseException:
        release()
        raise
