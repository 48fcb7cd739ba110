"""Engine flags shared by `formwork serve` and `formwork extract`: the
argparse group and the EngineConfig built from it (gateway/cli.py and
gateway/extract.py both import this; neither imports the other's module).
"""
from __future__ import annotations

import argparse

from formwork.schemas.config import DTYPES, EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    g.add_argument("--attention-backend", choices=("auto", "torch", "triton"),
                   default=d.attention_backend)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max positions)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-memory-gb / GPU memory)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb,
                   help="CPU: memory given to the paged KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--structured-outputs-backend", choices=("auto", "llguidance", "xgrammar", "outlines", "guidance"),
                   default=d.structured_backend)
    g.add_argument("--grammar-compile-threads", type=int, default=d.grammar_compile_threads)
    g.add_argument("--no-jump-forward", action="store_true")
    g.add_argument("--no-budget-aware", action="store_true",
                   help="do not close JSON-schema outputs before max_tokens runs out (per "
                        "request: structured_outputs.budget_aware)")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"),
                   default="raw_logprobs",
                   help="returned logprobs: the model's own (vLLM's default), or after the "
                        "grammar mask and penalties")
    g.add_argument("--no-adaptive-threads", action="store_true",
                   help="CPU: keep --num-threads fixed instead of sizing the forward's thread "
                        "team to the cores other processes leave free")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs: every step runs eagerly (default: decode "
                        "steps replay CUDA graphs on CUDA with the Triton attention backend)")
    g.add_argument("--no-packed-linears", action="store_true",
                   help="CPU bf16: call the plain linear instead of oneDNN weights packed at load")
    g.add_argument("--no-fused-elementwise", action="store_true",
                   help="CPU bf16: run norms, rotary and silu as separate torch ops, not fused C++ ones")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="engine processes behind this gateway, each with its own scheduler "
                        "and KV cache; requests routed by load and prefix affinity")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="worker processes per engine, the model sharded over torch.distributed "
                        "(gloo on CPU, NCCL on CUDA)")
    g.add_argument("--distributed-executor-backend", choices=("mp", "ray"),
                   default=d.distributed_executor_backend,
                   help="mp: local processes; ray: engines as Ray actors on a running Ray "
                        "cluster (README 'Scaling out')")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed arguments; raises ValueError naming the bad field."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, max_model_len=args.max_model_len,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        structured_backend=args.structured_outputs_backend,
        grammar_compile_threads=args.grammar_compile_threads,
        enable_jump_forward=not args.no_jump_forward, budget_aware=not args.no_budget_aware,
        num_threads=args.num_threads,
        adaptive_threads=not args.no_adaptive_threads, logprobs_mode=args.logprobs_mode,
        seed=args.seed, enforce_eager=args.enforce_eager,
        packed_linears=not args.no_packed_linears,
        fused_elementwise=not args.no_fused_elementwise,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend)
