"""Frozen engine configuration, validated once.

Each component receives only the fields it needs; what is learned at start-up
(the number of KV blocks) is passed separately, never written back here.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")   # "auto": gpu/attention_select.py
SCHEDULING_POLICIES = ("fcfs", "priority")          # as vLLM's --scheduling-policy


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: str | None = None            # None -> default SmolLM2-135M-Instruct GGUF
    # "auto": bf16 on CUDA, and on CPUs with native bf16 matmul (AMX / AVX512-BF16);
    # fp32 on other CPUs, where bf16 is emulated and several times slower.
    dtype: str = "auto"
    device: str = "auto"                 # "auto" | "cpu" | "cuda"
    attention_backend: str = "auto"      # "auto" | "torch" | "triton"
    max_model_len: int | None = None     # None -> the model's max positions
    block_size: int = 16
    num_kv_blocks: int | None = None     # None -> derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0      # CPU: bytes to give the paged KV cache
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory for weights+KV
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # "fcfs": first come, first served; "priority": waiting requests by (priority, arrival),
    # the lowest priority value first, and preemption takes the highest value, latest arrival
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    structured_backend: str = "auto"     # default backend when a request says "auto"
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 30.0
    enable_jump_forward: bool = True
    budget_aware: bool = True            # JSON schemas closed before max_tokens (grammar/budget.py)
    # greedy / temperature-only requests: pick without the grammar mask, check the pick,
    # mask and pick again only when it is refused (gpu/sampler.py, EngineCore._sample)
    defer_grammar_masks: bool = True
    num_threads: int | None = None       # torch intra-op threads; None -> torch default
    adaptive_threads: bool = True        # CPU: fewer threads while other processes take cores
    # returned logprobs (vLLM's logprobs_mode): the model's own ("raw_logprobs"), or
    # after grammar mask and penalties ("processed_logprobs", ruled-out entries left out)
    logprobs_mode: str = "raw_logprobs"
    seed: int = 0
    load_format: str = "auto"           # "dummy": config.json only, random weights (benchmarks)
    enforce_eager: bool = False          # CUDA: skip CUDA-graph capture
    packed_linears: bool = True          # CPU bf16: oneDNN weights packed once (gpu/cpu_linear.py)
    fused_elementwise: bool = True       # norm/rotary/silu fused: C++ on CPU bf16, Triton on CUDA
    # scale-out (README "Scaling out"): engines behind one gateway, workers per engine
    data_parallel_size: int = 1          # EngineCore processes, each with its own scheduler and KV cache
    tensor_parallel_size: int = 1        # worker processes per engine, model sharded over torch.distributed
    distributed_executor_backend: str = "mp"   # "mp": local processes; "ray": Ray actors

    @property
    def reads_weights(self) -> bool:
        """Whether the model folder must hold weights (not under load_format="dummy")."""
        return self.load_format != "dummy"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be auto, torch or triton, got {self.attention_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError("logprobs_mode: must be raw_logprobs or processed_logprobs, "
                             f"got {self.logprobs_mode!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: must be auto or dummy, got {self.load_format!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend: must be mp or ray, "
                             f"got {self.distributed_executor_backend!r}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size: must be 8, 16, 32 or 64, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens: must be >= block_size")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len: must be >= 2")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks: must be >= 2")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len without chunked prefill")
