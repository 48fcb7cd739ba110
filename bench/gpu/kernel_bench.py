"""Kernel timings on one GPU, printed as markdown tables.

- copy: device-to-device copy rate (bytes read + written per second), the ceiling.
- decode attention: `paged_attention` vs the torch path (gather the paged K/V
  through the block table, then SDPA) and vs SDPA alone on pre-gathered K/V;
  bandwidth = bytes of K/V read / time.
- prefill attention: chunks over a cached prefix, same comparison, TFLOP/s.
- bitmask apply: Triton vs xgrammar's apply (when importable) vs apply_bitmask_torch.
Every timed kernel is first checked against its baseline's output.

    python bench/gpu/kernel_bench.py [--dry-run] [--json PATH]

--dry-run: CPU, Triton interpreter, tiny sizes (proves the script, times nothing useful).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def bench(fn, device: str, reps: int) -> float:
    """Median seconds per call; on CUDA with L2 flushed between calls."""
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=reps * 4, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rate(device: str, nbytes: int) -> float:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), device, 20)


def _paged_case(num_seqs, q_len, ctx, heads, kv_heads, dim, block_size, dtype, device):
    """Uniform contexts of `ctx` tokens, blocks scattered at random."""
    import torch
    blocks_per_seq = ctx // block_size
    n_blocks = num_seqs * blocks_per_seq
    shape = (n_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    table = torch.randperm(n_blocks, device=device).view(num_seqs, blocks_per_seq).int()
    qsl = (torch.arange(num_seqs + 1, device=device) * q_len).int()
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs * q_len, heads, dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, table, qsl, seq_lens


def _torch_paged(q, k_cache, v_cache, table, q_len, ctx, scale, gathered=None):
    """The torch path: gather [B, KVH, ctx, D] through the table, then SDPA."""
    import torch
    import torch.nn.functional as F
    b = table.shape[0]
    _, bs, kvh, d = k_cache.shape
    if gathered is None:
        idx = table.long()
        gathered = [c[idx].view(b, ctx, kvh, d).transpose(1, 2) for c in (k_cache, v_cache)]
    k, v = gathered
    qs = q.view(b, q_len, -1, d).transpose(1, 2)                       # [B, H, q, D]
    mask = None
    if q_len > 1:
        pos = torch.arange(ctx, device=q.device)
        mask = pos[None, :] <= (ctx - q_len + torch.arange(q_len, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


def attention_rows(cases, device, reps):
    import torch
    from formwork.kernels.paged_attention import paged_attention
    rows = []
    for num_seqs, q_len, ctx, heads, kvh, dim, bs, dtype in cases:
        q, kc, vc, table, qsl, seq_lens = _paged_case(num_seqs, q_len, ctx, heads, kvh, dim, bs,
                                                      dtype, device)
        scale = dim ** -0.5
        out = paged_attention(q, kc, vc, table, qsl, seq_lens, scale)
        want = _torch_paged(q, kc, vc, table, q_len, ctx, scale)
        err = (out.float() - want.float()).abs().max().item()
        assert err < 3e-2, f"paged_attention differs from the torch path by {err}"
        idx = table.long()
        gathered = [c[idx].view(num_seqs, ctx, kvh, dim).transpose(1, 2) for c in (kc, vc)]
        t_triton = bench(lambda: paged_attention(q, kc, vc, table, qsl, seq_lens, scale, out=out),
                         device, reps)
        t_gather = bench(lambda: _torch_paged(q, kc, vc, table, q_len, ctx, scale), device, reps)
        t_sdpa = bench(lambda: _torch_paged(q, kc, vc, table, q_len, ctx, scale, gathered),
                       device, reps)
        kv_bytes = 2 * num_seqs * ctx * kvh * dim * kc.element_size()
        flops = 4 * num_seqs * heads * dim * q_len * (ctx - (q_len - 1) / 2)
        rows.append(dict(seqs=num_seqs, q_len=q_len, ctx=ctx, heads=f"{heads}/{kvh}x{dim}", bs=bs,
                         dtype=str(dtype).replace("torch.", ""), max_err=err,
                         triton_us=t_triton * 1e6, gather_sdpa_us=t_gather * 1e6,
                         sdpa_only_us=t_sdpa * 1e6, triton_GBps=kv_bytes / t_triton / 1e9,
                         triton_TFLOPs=flops / t_triton / 1e12,
                         speedup_vs_gather=t_gather / t_triton))
        del q, kc, vc, gathered
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def tiling_rows(cases, tilings, device, reps):
    """paged_attention time per (block_m, tile_n) override, for tuning the defaults."""
    from formwork.kernels.paged_attention import paged_attention
    rows = []
    for num_seqs, q_len, ctx, heads, kvh, dim, bs, dtype in cases:
        q, kc, vc, table, qsl, seq_lens = _paged_case(num_seqs, q_len, ctx, heads, kvh, dim, bs,
                                                      dtype, device)
        row = dict(seqs=num_seqs, q_len=q_len, ctx=ctx, heads=f"{heads}/{kvh}x{dim}")
        out = paged_attention(q, kc, vc, table, qsl, seq_lens, 0.1)
        row["auto_us"] = bench(lambda: paged_attention(q, kc, vc, table, qsl, seq_lens, 0.1,
                                                       out=out), device, reps) * 1e6
        for block_m, tile_n in tilings:
            if block_m < heads // kvh:
                continue
            fn = lambda: paged_attention(q, kc, vc, table, qsl, seq_lens, 0.1, out=out,  # noqa: E731
                                         block_m=block_m, tile_n=tile_n)
            row[f"m{block_m}_n{tile_n}_us"] = bench(fn, device, reps) * 1e6
        rows.append(row)
    return rows


def bitmask_rows(batches, vocab, device, reps):
    import torch
    from formwork.kernels.bitmask import apply_bitmask_ref, apply_bitmask_torch, apply_bitmask_triton
    try:
        from xgrammar import apply_token_bitmask_inplace as xgr_apply
    except ImportError:
        xgr_apply = None
    rows = []
    words = (vocab + 31) // 32
    for batch in batches:
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(batch, vocab, dtype=dtype, device=device)
            bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32,
                                    device=device)
            check = logits[:1].cpu()
            apply_bitmask_ref(check, bitmask[:1].cpu())
            got = logits.clone()
            apply_bitmask_triton(got, bitmask)
            assert torch.equal(got[:1].cpu(), check), "Triton bitmask differs from the reference"
            row = dict(batch=batch, vocab=vocab, dtype=str(dtype).replace("torch.", ""),
                       triton_us=bench(lambda: apply_bitmask_triton(logits, bitmask), device, reps) * 1e6,
                       torch_us=bench(lambda: apply_bitmask_torch(logits, bitmask), device, reps) * 1e6)
            if xgr_apply is not None:
                row["xgrammar_us"] = bench(lambda: xgr_apply(logits, bitmask), device, reps) * 1e6
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    ap.add_argument("--json", default=None, help="also write all rows to this file")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("kernel_bench: torch sees no CUDA device (use --dry-run on CPU)")
    f32, bf16 = torch.float32, torch.bfloat16
    if args.dry_run:
        decode = [(2, 1, 64, 4, 2, 16, 16, f32)]
        prefill = [(2, 16, 48, 4, 2, 16, 16, f32)]
        batches, vocab, reps, copy_bytes = [1, 4], 4096, 2, 1 << 24
        tilings = [(16, 16), (32, 32)]
    else:
        decode = [(s, 1, c, h, kvh, d, 16, bf16) for s in (64, 256) for c in (1024, 4096)
                  for h, kvh, d in ((9, 3, 64), (32, 8, 128))]
        prefill = [(8, 512, 2048, 9, 3, 64, 16, bf16), (4, 1024, 1024, 32, 8, 128, 16, bf16),
                   (4, 1024, 4096, 32, 8, 128, 16, bf16)]
        batches, vocab, reps, copy_bytes = [1, 64, 512], 49152, 50, 1 << 30
        tilings = [(16, 32), (16, 64), (16, 128), (32, 64), (64, 32), (64, 64), (128, 32), (128, 64)]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"}
    result["copy_GBps"] = copy_rate(device, copy_bytes) / 1e9
    print(f"## kernels on {result['device']}\n\ncopy rate (read + write): "
          f"{result['copy_GBps']:.0f} GB/s; attention reads K/V only, so compare "
          "triton_GBps with it directly\n", flush=True)
    for name, cases in (("decode attention", decode), ("prefill attention", prefill)):
        result[name] = attention_rows(cases, device, reps)
        print(f"### {name}\n\n{markdown(result[name])}\n", flush=True)
    cases = list(dict.fromkeys(decode[:1] + decode[-2:] + prefill[:1] + prefill[-1:]))
    result["tiling"] = tiling_rows(cases, tilings, device, reps)
    print(f"### paged_attention tilings (block_m, tile_n)\n\n{markdown(result['tiling'])}\n",
          flush=True)
    result["bitmask"] = bitmask_rows(batches, vocab, device, reps)
    print(f"### bitmask apply\n\n{markdown(result['bitmask'])}\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
