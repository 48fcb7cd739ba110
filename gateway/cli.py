"""The `formwork` command: `formwork serve [MODEL] ...` and `formwork extract ...`.

`extract` lives in gateway/extract.py (add_arguments(parser), run(args) -> int)
and is imported only when that subcommand runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

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
        enable_jump_forward=not args.no_jump_forward, num_threads=args.num_threads,
        adaptive_threads=not args.no_adaptive_threads, logprobs_mode=args.logprobs_mode,
        seed=args.seed, enforce_eager=args.enforce_eager,
        packed_linears=not args.no_packed_linears,
        fused_elementwise=not args.no_fused_elementwise)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model name, .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FORMWORK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(env FORMWORK_API_KEY)")
    p.add_argument("--max-request-body-mb", type=float, default=8.0,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the model name)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(p)


def serve(args: argparse.Namespace) -> int:
    from formwork.gateway.api_server import run_server

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
    except ValueError as e:
        print(f"formwork serve: {e}", file=sys.stderr)
        return 2
    run_server(config, host=args.host, port=args.port, served_model_names=args.served_model_name,
               api_key=args.api_key, log_level=args.log_level,
               max_request_body_mb=args.max_request_body_mb)
    return 0


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="formwork", description="Structured-output-first LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    extract = sub.add_parser("extract", help="extract structured data from text with a schema")
    if argv[:1] == ["extract"]:
        from formwork.gateway import extract as extract_mod
        extract_mod.add_arguments(extract)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    from formwork.gateway import extract as extract_mod
    return extract_mod.run(args)


if __name__ == "__main__":
    sys.exit(main())
