"""What every rank builds at start-up, the same way on rank 0 (the Executor's
forward thread) and on tensor-parallel worker processes: device, dtype, the
model (or this rank's shard of it), the CPU fast paths, the paged KV cache.

Owns nothing after it returns: the caller (Executor / TP worker) owns the
model and the KV tensors.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from formwork.gpu.attention import AttentionBackend, allocate_kv_cache, kv_cache_bytes_per_block
from formwork.gpu.attention_select import get_attention_backend, resolve_backend_name
from formwork.gpu.cpu_linear import pack_linears, packing_supported
from formwork.gpu.cpu_threads import usable_cpus
from formwork.gpu.loader import load_model
from formwork.gpu.model import CPU_FUSED_OPS, CUDA_FUSED_OPS, ModelConfig
from formwork.gpu.tensor_parallel import TPGroup, shard_config
from formwork.kernels import cpu_decode_attention, cpu_fused_ops, cpu_sampling
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.executor")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(slots=True)
class RankState:
    model: torch.nn.Module
    kv_caches: list                  # per layer (k_cache, v_cache), this rank's KV heads only
    num_blocks: int                  # identical on every rank
    max_model_len: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    backend: AttentionBackend        # also model.attn_backend


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


def pick_device(name: str, tp_rank: int | None = None) -> torch.device:
    """The device; with `tp_rank` (tensor parallel) on CUDA, one GPU per rank: cuda:<rank>."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
    if name == "cuda" and tp_rank is not None:
        if tp_rank >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size: rank {tp_rank} needs GPU {tp_rank}, but torch "
                             f"sees {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(tp_rank)
        return torch.device("cuda", tp_rank)
    return torch.device(name)


def forward_threads(config: EngineConfig) -> int | None:
    """Torch intra-op threads for one rank: the configured count; or (CPU, tensor
    parallel) the usable cores shared out between the ranks; or the usable cores
    where a cgroup CPU quota leaves fewer than torch's default (which counts the
    affinity mask: a 2-CPU container on a 64-core host); None: torch's default."""
    if config.num_threads:
        return config.num_threads
    cores = usable_cpus()
    if config.tensor_parallel_size > 1:
        return max(1, cores // config.tensor_parallel_size)
    if cores < torch.get_num_threads():
        return cores
    return None


def _num_blocks(config: EngineConfig, rank_cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device) -> int:
    """KV blocks this rank can hold. CPU: the ranks share one host, so each gets
    kv_cache_memory_gb / N for its 1/N of the KV heads (as many blocks as TP=1)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(rank_cfg.num_hidden_layers, config.block_size,
                                         rank_cfg.num_key_value_heads, rank_cfg.head_dim, dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(config.kv_cache_memory_gb * (1 << 30)) // config.tensor_parallel_size
    return max(2, budget // per_block)


def prebuild_cpu_kernels(config: EngineConfig, dtype: torch.dtype) -> None:
    """Compile the C++ CPU extensions this engine will use side by side (each compile is
    one single-threaded compiler process; all are cached after the first start), so
    that a fresh machine's first start waits for the longest build, not their sum."""
    wanted = [cpu_sampling.available]
    if resolve_backend_name(config.attention_backend, "cpu") == "torch":
        wanted.append(cpu_decode_attention.available)
    if config.fused_elementwise and dtype == torch.bfloat16:
        wanted.append(cpu_fused_ops.available)
    with ThreadPoolExecutor(len(wanted), thread_name_prefix="kernel-build") as pool:
        list(pool.map(lambda available: available(), wanted))


def build_rank(config: EngineConfig, model_dir, device: torch.device,
               tp: TPGroup | None = None) -> RankState:
    """Load the model (this rank's shard under `tp`), switch on the CPU fast paths,
    allocate the KV cache. Under `tp` every rank must call this together (the KV
    block count is agreed with an all-reduce)."""
    dtype = resolve_dtype(config.dtype, device)
    mcfg = ModelConfig.from_dir(model_dir)
    rank_cfg = shard_config(mcfg, tp.size) if tp is not None else mcfg
    if device.type == "cpu":
        prebuild_cpu_kernels(config, dtype)
    backend = get_attention_backend(config.attention_backend, device)
    ops = None                        # the torch reference ops
    if config.fused_elementwise and device.type == "cuda":
        ops = CUDA_FUSED_OPS           # Triton (kernels/fused_ops.py)
    elif config.fused_elementwise and device.type == "cpu" and dtype == torch.bfloat16 \
            and cpu_fused_ops.available():
        ops = CPU_FUSED_OPS            # C++ (kernels/cpu_fused_ops.py)
    model = load_model(model_dir, dtype=dtype, device=device, attn_backend=backend,
                       ops=ops, tp=tp, load_format=config.load_format)
    if config.packed_linears and packing_supported(dtype, device):
        n = pack_linears(model)
        if tp is None or tp.rank == 0:
            log.info("packed oneDNN linears: %d", n)
    max_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    if config.max_model_len and config.max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {mcfg.max_position_embeddings}")
    num_blocks = _num_blocks(config, rank_cfg, dtype, device)
    if tp is not None:
        num_blocks = tp.min_int(num_blocks)
    kv = allocate_kv_cache(rank_cfg.num_hidden_layers, num_blocks, config.block_size,
                           rank_cfg.num_key_value_heads, rank_cfg.head_dim, dtype, device)
    return RankState(model, kv, num_blocks, max_len, mcfg.vocab_size, device, dtype, backend)
