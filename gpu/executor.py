"""In-process executor: owns the model, the KV cache and the ModelRunner, and
runs the forward on one worker thread so that the EngineCore can fill grammar
bitmasks on its own thread meanwhile (torch releases the GIL in its kernels).

`execute_model(plan, non_block=True)` returns at once; `sample_tokens(bitmask)`
waits for that forward and samples. One step in flight at a time.

Under tensor parallelism that worker thread is rank 0: it also owns the
worker processes of ranks 1..N-1 (gpu/tp_worker.py) and the process group, and
broadcasts each plan to them before its own forward; the model, KV cache and
runner it owns are rank 0's shards.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from formwork.gpu import tp_worker
from formwork.gpu.cpu_threads import ThreadGovernor, quota_limited
from formwork.gpu.cuda_graph import DecodeGraphRunner, GraphFactory, capture_sizes, pick_graph_factory
from formwork.gpu.model import ModelConfig
from formwork.gpu.model_runner import ModelRunner
from formwork.gpu.rank_setup import build_rank, forward_threads, pick_device
from formwork.gpu.tensor_parallel import TPGroup, free_port, shard_config
from formwork.schemas.config import EngineConfig
from formwork.schemas.scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("formwork.executor")


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """Learned at start-up; passed to the core, never written into the config."""
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    attention_backend: str
    load_seconds: float                       # including CUDA-graph capture
    cuda_graph_sizes: tuple[int, ...] = ()    # decode batch sizes replayed as graphs; () = eager only


def _capture_decode_graphs(config: EngineConfig, model, kv, max_len: int, device: torch.device,
                           factory: GraphFactory) -> DecodeGraphRunner:
    graphs = DecodeGraphRunner(model, kv, sizes=capture_sizes(config.max_num_seqs),
                               block_size=config.block_size,
                               max_blocks_per_seq=-(-max_len // config.block_size),
                               device=device, factory=factory)
    t0 = time.perf_counter()
    graphs.capture()
    log.info("captured decode graphs for batch sizes %s in %.2fs", graphs.sizes, time.perf_counter() - t0)
    return graphs


def _check_tensor_parallel(config: EngineConfig, model_dir) -> None:
    """ValueError for what would fail on a worker (a worker failing before the
    rendezvous would leave rank 0 waiting for it): refuse before anything is spawned."""
    n = config.tensor_parallel_size
    shard_config(ModelConfig.from_dir(model_dir), n)
    if pick_device(config.device).type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size: {n} needs {n} GPUs (one per rank); torch sees "
                         f"{torch.cuda.device_count()}")


class Executor:
    def __init__(self, config: EngineConfig, model_dir, *, graph_factory: GraphFactory | None = None,
                 master_addr: str = "127.0.0.1"):
        """graph_factory: tests only, stands in for CUDA-graph capture on any device
        (see gpu/cuda_graph.py); by default graphs are captured on CUDA with the
        Triton backend unless config.enforce_eager.

        All torch work (load, capture, forward, sampling) runs on the one worker
        thread. Measured on CPU (libgomp, 2 cores): once a second thread has run
        an OpenMP-parallel torch op, both threads' parallel regions lose their
        spin-wait and a bf16 decode step got ~1.6x slower; the engine thread
        therefore keeps to small ops (grammar bitmasks, bookkeeping).

        tensor_parallel_size N > 1: that worker thread is rank 0 of a
        torch.distributed group (gloo on CPU, NCCL on CUDA) whose ranks 1..N-1
        are processes spawned here (gpu/tp_worker.py), meeting at
        tcp://<master_addr>:<free port>. They are local processes whatever
        distributed_executor_backend says (that places whole engines: under
        "ray" an engine actor's workers run on its node). Each step rank 0
        broadcasts the plan, all ranks run the forward on their shard, rank 0
        alone computes logits and samples (gpu/tensor_parallel.py says what is
        sharded)."""
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            _check_tensor_parallel(config, model_dir)
        self._workers: list = []
        self._tp: TPGroup | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="formwork-forward")
        try:
            init_method = None
            if tp_size > 1:
                init_method = f"tcp://{master_addr}:{free_port(master_addr)}"
                self._workers = tp_worker.start_workers(config, model_dir, init_method)
            self._pool.submit(self._init_on_worker, config, model_dir, graph_factory,
                              init_method).result()
        except BaseException:
            if self._tp is not None:
                self._tp.destroy()
            self._pool.shutdown(wait=True)
            tp_worker.stop_workers(self._workers, timeout=0.0)
            raise
        self._inflight: tuple[SchedulerOutput, cf.Future] | None = None
        self.timings: dict[str, float] = {}   # last step: submitted/forward_start/forward_end (perf_counter)

    def _init_on_worker(self, config: EngineConfig, model_dir, graph_factory: GraphFactory | None,
                        init_method: str | None) -> None:
        t0 = time.perf_counter()
        if (threads := forward_threads(config)) is not None:
            torch.set_num_threads(threads)   # per-thread OpenMP setting: here, not the caller's
        self.device = pick_device(config.device, 0 if init_method is not None else None)
        # under TP the other ranks are this machine's other processes, and under a
        # cgroup CPU quota the host's cores are everyone's: no governor
        self.governor = (ThreadGovernor(torch.get_num_threads())
                         if config.adaptive_threads and self.device.type == "cpu"
                         and init_method is None and not quota_limited() else None)
        if init_method is not None:
            self._tp = TPGroup.init(0, config.tensor_parallel_size, init_method, self.device)
        st = build_rank(config, model_dir, self.device, self._tp)
        # CUDA graphs stay off under TP (capturing the all-reduces is not wired up)
        factory = pick_graph_factory(self.device.type, st.backend,
                                     config.enforce_eager or self._tp is not None, graph_factory)
        graphs = None if factory is None else _capture_decode_graphs(
            config, st.model, st.kv_caches, st.max_model_len, self.device, factory)
        if graphs is None:
            log.info("decode graphs: off (device %s, attention %s, enforce_eager %s, tensor parallel %d)",
                     self.device.type, st.backend.name, config.enforce_eager,
                     config.tensor_parallel_size)
        self.runner = ModelRunner(st.model, st.kv_caches, block_size=config.block_size,
                                  device=self.device, graphs=graphs, logprobs_mode=config.logprobs_mode)
        self.info = ExecutorInfo(st.num_blocks, st.max_model_len, st.vocab_size, str(self.device),
                                 str(st.dtype).removeprefix("torch."),
                                 st.backend.name, time.perf_counter() - t0,
                                 tuple(graphs.sizes) if graphs is not None else ())

    def _forward(self, plan: SchedulerOutput):
        if self.governor is not None and (threads := self.governor.sample()) is not None:
            torch.set_num_threads(threads)
            log.info("forward threads: %d (other processes used %.1f cores)", threads,
                     self.governor.others)
        self.timings["forward_start"] = time.perf_counter()
        try:
            if self._tp is not None:
                tp_worker.check_workers(self._workers)
                self._tp.broadcast_plan(plan)
            return self.runner.execute_model(plan)
        finally:
            self.timings["forward_end"] = time.perf_counter()

    def execute_model(self, plan: SchedulerOutput, non_block: bool = True):
        assert self._inflight is None, "one step in flight at a time"
        self.timings["submitted"] = time.perf_counter()
        fut = self._pool.submit(self._forward, plan)
        self._inflight = (plan, fut)
        if not non_block:
            fut.result()
        return fut

    def sample_tokens(self, bitmask: torch.Tensor | None, mask_req_ids: list[str] | None = None,
                      deferred_req_ids: list[str] = ()) -> ModelRunnerOutput:
        """Waits for the in-flight forward (re-raising its error) and samples (the
        bitmask's rows are mask_req_ids', default the plan's structured requests;
        deferred_req_ids are sampled unmasked and kept for `resample`)."""
        assert self._inflight is not None, "sample_tokens without execute_model"
        plan, fut = self._inflight
        self._inflight = None
        logits = fut.result()
        return self._pool.submit(self.runner.sample, plan, logits, bitmask, mask_req_ids,
                                 deferred_req_ids).result()

    def candidates(self, req_ids: list[str], k: int) -> list[list[int]]:
        """After sample_tokens, for some of its deferred requests: each greedy one's
        best tokens in masked-argmax order ([] for sampled ones), Sampler.candidates."""
        return self._pool.submit(self.runner.candidates, req_ids, k).result()

    def resample(self, req_ids: list[str], bitmask: torch.Tensor) -> list[int]:
        """Masked picks, after sample_tokens, for some of its deferred requests."""
        return self._pool.submit(self.runner.resample, req_ids, bitmask).result()

    def cancel_inflight(self) -> None:
        """After a failed step: wait the forward out so the next step starts clean."""
        if self._inflight is not None:
            _plan, fut = self._inflight
            self._inflight = None
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the caller already reports the step failure
                pass

    def shutdown(self) -> None:
        """Idempotent. Under TP: tells the workers to stop, waits for them (ending
        those that hang), leaves the process group."""
        if self._tp is not None:
            tp, self._tp = self._tp, None
            try:
                self._pool.submit(self._stop_ranks, tp).result(timeout=tp_worker.JOIN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead worker: end the rest below
                log.warning("tensor-parallel shutdown: a worker did not take the stop message")
        tp_worker.stop_workers(self._workers)
        self._workers = []
        self._pool.shutdown(wait=True)

    def _stop_ranks(self, tp: TPGroup) -> None:
        if all(p.is_alive() for p in self._workers):
            tp.broadcast_plan(None)
        tp.destroy()
