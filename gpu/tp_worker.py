"""Tensor-parallel worker processes: ranks 1..N-1 of one engine.

Rank 0 is the Executor's forward thread in the engine process (gpu/executor.py);
it spawns these processes, and each one owns its shard of the model, its own
paged KV cache (its KV heads only) and a ModelRunner that never samples. The
loop: receive the step's SchedulerOutput from rank 0 (broadcast), run the same
forward (joining the all-reduces), repeat; a None plan means stop. Tokens that
rank 0 samples reach the workers inside the next plan (CachedRequestData
carries the tokens scheduled each step), so the runners stay in step.

A worker dies with the engine: SIGTERM from the kernel when its parent exits
(PR_SET_PDEATHSIG; the default action, which ends even a blocked collective),
and a collective fails when a peer's connection closes.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import weakref

import torch

from formwork.gpu.child_process import die_with_parent, main_module_not_reimported
from formwork.gpu.model_runner import ModelRunner
from formwork.gpu.rank_setup import build_rank, forward_threads, pick_device
from formwork.gpu.tensor_parallel import TPGroup
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.tp_worker")

JOIN_TIMEOUT_S = 10.0


def start_workers(config: EngineConfig, model_dir, init_method: str) -> list:
    """Spawn ranks 1..N-1 (not daemonic: they may start children of their own,
    e.g. a CUDA driver helper; they still die with this process)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_worker, name=f"TPWorker-{rank}", daemon=False,
                         args=(config, str(model_dir), rank, init_method, os.getpid(),
                               logging.getLogger().getEffectiveLevel()))
             for rank in range(1, config.tensor_parallel_size)]
    with main_module_not_reimported():
        for p in procs:
            p.start()
    # before multiprocessing's own exit hook, which would join them forever
    atexit.register(_end_at_exit, [weakref.ref(p) for p in procs])
    return procs


def _end_at_exit(refs: list) -> None:
    procs = [p for r in refs if (p := r()) is not None and p.is_alive()]
    for p in procs:
        p.terminate()
    stop_workers(procs, timeout=5.0)


def stop_workers(procs: list, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Wait for workers told to stop; end those that do not (by their process only)."""
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            log.warning("tensor-parallel worker %s did not stop; terminating it", p.name)
            p.terminate()
            p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout)


def check_workers(procs: list) -> None:
    """RuntimeError naming the first dead worker (before a step, so that rank 0
    does not wait on a collective a dead peer will never join)."""
    for p in procs:
        if not p.is_alive():
            raise RuntimeError(f"tensor-parallel worker {p.name} (pid {p.pid}) exited "
                               f"with code {p.exitcode}")


def run_worker(config: EngineConfig, model_dir: str, rank: int, init_method: str,
               parent_pid: int, log_level: int = logging.INFO) -> None:
    """Process entry point (multiprocessing spawn target)."""
    die_with_parent()
    if os.getppid() != parent_pid:          # the parent died before prctl took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine owns Ctrl-C and tells us
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (threads := forward_threads(config)) is not None:
        torch.set_num_threads(threads)
    device = pick_device(config.device, rank)
    tp = TPGroup.init(rank, config.tensor_parallel_size, init_method, device)
    try:
        state = build_rank(config, model_dir, device, tp)
        runner = ModelRunner(state.model, state.kv_caches, block_size=config.block_size,
                             device=device, samples=False)
        while (plan := tp.broadcast_plan(None)) is not None:
            try:
                runner.execute_model(plan)
            except Exception:  # noqa: BLE001 - rank 0 meets the same error on the same plan
                log.exception("rank %d: step failed", rank)
    finally:
        tp.destroy()
    # A normal interpreter exit here sometimes aborted in C++ static destructors
    # ("terminate called without an active exception", a distributed thread still
    # joinable; ~1 in 5 runs, gloo, torch 2.13): the work is done, skip them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
