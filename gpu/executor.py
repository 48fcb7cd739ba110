"""In-process executor: owns the model, the KV cache and the ModelRunner, and
runs the forward on one worker thread so that the EngineCore can fill grammar
bitmasks on its own thread meanwhile (torch releases the GIL in its kernels).

`execute_model(plan, non_block=True)` returns at once; `sample_tokens(bitmask)`
waits for that forward and samples. One step in flight at a time.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from formwork.gpu.attention import allocate_kv_cache, kv_cache_bytes_per_block
from formwork.gpu.attention_select import get_attention_backend
from formwork.gpu.cpu_linear import pack_linears, packing_supported
from formwork.gpu.cpu_threads import ThreadGovernor
from formwork.gpu.cuda_graph import DecodeGraphRunner, GraphFactory, capture_sizes, pick_graph_factory
from formwork.gpu.loader import load_model
from formwork.gpu.model import CPU_FUSED_OPS, ModelConfig
from formwork.gpu.model_runner import ModelRunner
from formwork.kernels import cpu_fused_ops
from formwork.schemas.config import EngineConfig
from formwork.schemas.scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("formwork.executor")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


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


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
    return torch.device(name)


def _num_blocks(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(mcfg.num_hidden_layers, config.block_size,
                                         mcfg.num_key_value_heads, mcfg.head_dim, dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(config.kv_cache_memory_gb * (1 << 30))
    return max(2, budget // per_block)


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


class Executor:
    def __init__(self, config: EngineConfig, model_dir, *, graph_factory: GraphFactory | None = None):
        """graph_factory: tests only, stands in for CUDA-graph capture on any device
        (see gpu/cuda_graph.py); by default graphs are captured on CUDA with the
        Triton backend unless config.enforce_eager.

        All torch work (load, capture, forward, sampling) runs on the one worker
        thread. Measured on CPU (libgomp, 2 cores): once a second thread has run
        an OpenMP-parallel torch op, both threads' parallel regions lose their
        spin-wait and a bf16 decode step got ~1.6x slower; the engine thread
        therefore keeps to small ops (grammar bitmasks, bookkeeping)."""
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="formwork-forward")
        try:
            self._pool.submit(self._init_on_worker, config, model_dir, graph_factory).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        self._inflight: tuple[SchedulerOutput, cf.Future] | None = None
        self.timings: dict[str, float] = {}   # last step: submitted/forward_start/forward_end (perf_counter)

    def _init_on_worker(self, config: EngineConfig, model_dir, graph_factory: GraphFactory | None) -> None:
        t0 = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)   # per-thread OpenMP setting: here, not the caller's
        self.device = _pick_device(config.device)
        self.governor = (ThreadGovernor(torch.get_num_threads())
                         if config.adaptive_threads and self.device.type == "cpu" else None)
        dtype = resolve_dtype(config.dtype, self.device)
        mcfg = ModelConfig.from_dir(model_dir)
        backend = get_attention_backend(config.attention_backend, self.device)
        backend_name = backend.name
        model = load_model(model_dir, dtype=dtype, device=self.device)
        model.attn_backend = backend
        if config.packed_linears and packing_supported(dtype, self.device):
            log.info("packed oneDNN linears: %d", pack_linears(model))
        if config.fused_elementwise and self.device.type == "cpu" and dtype == torch.bfloat16 \
                and cpu_fused_ops.available():
            model.ops = CPU_FUSED_OPS
        max_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        if config.max_model_len and config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mcfg.max_position_embeddings}")
        num_blocks = _num_blocks(config, mcfg, dtype, self.device)
        kv = allocate_kv_cache(mcfg.num_hidden_layers, num_blocks, config.block_size,
                               mcfg.num_key_value_heads, mcfg.head_dim, dtype, self.device)
        factory = pick_graph_factory(self.device.type, backend.needs_groups, config.enforce_eager,
                                     graph_factory)
        graphs = None if factory is None else _capture_decode_graphs(
            config, model, kv, max_len, self.device, factory)
        if graphs is None:
            log.info("decode graphs: off (device %s, attention %s, enforce_eager %s)",
                     self.device.type, backend_name, config.enforce_eager)
        self.runner = ModelRunner(model, kv, block_size=config.block_size, device=self.device,
                                  graphs=graphs, logprobs_mode=config.logprobs_mode)
        self.info = ExecutorInfo(num_blocks, max_len, mcfg.vocab_size, str(self.device),
                                 str(dtype).removeprefix("torch."),
                                 backend_name, time.perf_counter() - t0,
                                 tuple(graphs.sizes) if graphs is not None else ())

    def _forward(self, plan: SchedulerOutput):
        if self.governor is not None and (threads := self.governor.sample()) is not None:
            torch.set_num_threads(threads)
            log.info("forward threads: %d (other processes used %.1f cores)", threads,
                     self.governor.others)
        self.timings["forward_start"] = time.perf_counter()
        try:
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

    def sample_tokens(self, bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        """Waits for the in-flight forward (re-raising its error) and samples."""
        assert self._inflight is not None, "sample_tokens without execute_model"
        plan, fut = self._inflight
        self._inflight = None
        logits = fut.result()
        return self._pool.submit(self.runner.sample, plan, logits, bitmask).result()

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
        self._pool.shutdown(wait=True)
