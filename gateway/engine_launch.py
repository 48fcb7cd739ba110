"""How the gateway's engine clients reach their EngineCore processes: the
socket endpoints they bind, the launchers that start an engine, and how a
lingering one is ended.

A launcher is `launcher(config, input_addr, output_addr)` -> a process-like
handle: is_alive(), sentinel (a readable fd, closed when it ends), pid,
exitcode, join(timeout), terminate(), kill(). The default is
`core.engine_proc.start_engine_process` (a local spawned process); a Ray
backend supplies its own and binds TCP endpoints (`bind_host`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import zmq

from formwork.core.engine_proc import start_engine_process
from formwork.schemas.config import EngineConfig

Launcher = Callable[[EngineConfig, str, str], Any]


def tcp_bind(sock: zmq.Socket, host: str) -> str:
    """Bind `sock` to a random TCP port on `host`; the endpoint a peer connects to."""
    sock.bind(f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def bind_pair(in_sock: zmq.Socket, out_sock: zmq.Socket, ipc_dir: str | None,
              bind_host: str | None) -> tuple[str, str]:
    """Bind the input and output sockets: ipc:// in `ipc_dir` when `bind_host` is
    None, else tcp://bind_host:<random>. Returns (input_addr, output_addr)."""
    if bind_host is not None:
        return tcp_bind(in_sock, bind_host), tcp_bind(out_sock, bind_host)
    assert ipc_dir is not None
    in_addr = f"ipc://{os.path.join(ipc_dir, 'input')}"
    out_addr = f"ipc://{os.path.join(ipc_dir, 'output')}"
    in_sock.bind(in_addr)
    out_sock.bind(out_addr)
    return in_addr, out_addr


def rank_devices(rank: int, size: int, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES value for data-parallel engine `rank` of `size`:
    its own entry when `visible` (the parent's value) lists at least `size`
    devices, otherwise None (leave the environment alone: engines share what
    is visible, e.g. CPU engines, or one GPU split by gpu_memory_utilization)."""
    if size == 1 or not visible:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    return devices[rank] if len(devices) >= size else None


def dp_engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Data-parallel engine `rank`'s own config: data_parallel_size 1; when it has
    no GPU of its own (rank_devices is None) the engines share the visible
    GPUs, and each takes 1/N of gpu_memory_utilization (they size their KV
    caches at the same time, from the same free memory). kv_cache_memory_gb
    (CPU) stays per engine."""
    size = config.data_parallel_size
    util = config.gpu_memory_utilization
    if size > 1 and rank_devices(rank, size, os.environ.get("CUDA_VISIBLE_DEVICES")) is None:
        util /= size
    return dataclasses.replace(config, data_parallel_size=1, gpu_memory_utilization=util)


def rank_launcher(rank: int, size: int, base: Launcher | None = None) -> Launcher:
    """`base` (default: a local process) with engine `rank` pinned to its own
    device when the parent's CUDA_VISIBLE_DEVICES lists one per engine."""
    base = base or start_engine_process

    def launch(config: EngineConfig, input_addr: str, output_addr: str):
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = rank_devices(rank, size, saved)
        if devices is None:
            return base(config, input_addr, output_addr)
        os.environ["CUDA_VISIBLE_DEVICES"] = devices       # a spawned child copies it at start
        try:
            return base(config, input_addr, output_addr)
        finally:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return launch


def end_process(proc, timeout_s: float) -> None:
    """Wait `timeout_s` for an engine asked to stop (blocking), then terminate it,
    then kill it; `proc` is a launcher's process-like handle."""
    proc.join(timeout_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
