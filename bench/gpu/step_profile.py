"""Where a CUDA decode step's time goes: torch profiler over a few pure decode
steps of B requests (graphs replayed as in serving), GPU kernel time grouped by
kernel and compared with the step's wall time and the weights' read floor.

    python bench/gpu/step_profile.py --model DIR --load-format dummy [--batch 32] [--steps 8]
"""
from __future__ import annotations

import argparse
import collections
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no GPU kernels)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from formwork.core.engine_core import EngineCore
    from formwork.schemas.config import EngineConfig
    from formwork.schemas.engine import EngineCoreRequest
    from formwork import SamplingParams

    config = EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                          max_num_seqs=args.batch, num_kv_blocks=args.batch * 16 + 16)
    core = EngineCore(config)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    weights = sum(p.numel() * p.element_size() for p in core.executor.runner.model.parameters())
    params = SamplingParams(temperature=0, max_tokens=10 * args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=list(range(100, 164)),
                                           sampling_params=params))
    for _ in range(4):                        # prefill, then decode steps (graphs warm)
        core.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    wall = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        sync()
    kernels: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    gpu_ms = sum(kernels.values()) / 1e3 / args.steps
    floor_ms = weights / 4.2e12 * 1e3      # the H200's measured copy rate (read + write)
    print(f"batch {args.batch}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu_ms:.2f} ms/step; "
          f"{weights / 1e9:.1f} GB of weights take {floor_ms:.2f} ms at 4.2 TB/s")
    print("| kernel | ms/step | share |\n|---|---|---|")
    total = sum(kernels.values())
    for name, us in kernels.most_common(args.top):
        print(f"| {name[:90]} | {us / 1e3 / args.steps:.3f} | {us / total:.0%} |")
    core.shutdown()


if __name__ == "__main__":
    main()
