"""Unified paged attention: Triton kernel against the einsum reference.

Without CUDA the kernel runs in the Triton interpreter (see test_kernels_bitmask)
at tiny sizes, in fp32 and fp16: the triton 3.9 interpreter's `tl.dot` returns
garbage for bf16 operands, so bf16 is checked on CUDA only.
"""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from formwork.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HEAD_DIMS = [64, 128] if CUDA else [16, 32]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """specs: [(q_len, seq_len)]. Blocks are scattered at random; cache rows no
    sequence owns are NaN, so reading past a context shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for _, s in specs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_table = torch.zeros(len(specs), max(blocks_per_seq) + 1, dtype=torch.int32)
    for s, (_, seq_len) in enumerate(specs):
        own = [perm.pop() for _ in range(blocks_per_seq[s])]
        block_table[s, : len(own)] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slots = torch.tensor(own)[pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                seq_len, num_kv_heads, head_dim, generator=gen)
    q_lens = [ql for ql, _ in specs]
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in specs], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE)
            for t in (q, k_cache, v_cache, block_table, query_start_loc, seq_lens)]


def _check(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, **tiling):
    args = _batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    expected = paged_attention_ref(*args, scale)
    actual = paged_attention(*args, scale, **tiling)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return args, actual


def test_ref_matches_sdpa_for_fresh_prefills():
    """The reference itself: no cached prefix means plain causal attention."""
    specs = [(7, 7), (19, 19)]
    q, k_cache, v_cache, block_table, qsl, seq_lens = _batch(specs, 6, 2, 16, 8, torch.float32, 1)
    out = paged_attention_ref(q, k_cache, v_cache, block_table, qsl, seq_lens, 0.3)
    for s, (q_len, _) in enumerate(specs):
        blocks = block_table[s, : math.ceil(q_len / 8)].long()
        k = k_cache[blocks].reshape(-1, 2, 16)[:q_len].transpose(0, 1)
        v = v_cache[blocks].reshape(-1, 2, 16)[:q_len].transpose(0, 1)
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        want = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k, v, is_causal=True, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[rows], want.transpose(0, 1).to(out.dtype))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_mixed_batch(block_size, num_heads, num_kv_heads):
    """Decodes, a fresh prefill, and a prefill chunk on top of cached blocks."""
    specs = [(1, 37), (13, 13), (1, 1), (9, 2 * block_size + 5), (1, block_size)]
    if CUDA:
        specs += [(1, 4000), (700, 700), (300, 2300)] + [(1, 100 + 37 * i) for i in range(40)]
    _check(specs, num_heads, num_kv_heads, HEAD_DIMS[0], block_size, torch.float32)


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_block_boundaries(offset):
    """Contexts ending one before, at and one after a block boundary."""
    bs = 16
    specs = [(1, 2 * bs + offset), (3, bs + offset), (bs, 2 * bs + offset), (1, bs + offset)]
    _check(specs, 6, 2, HEAD_DIMS[-1], bs, torch.float32, seed=offset + 5)


@pytest.mark.parametrize("block_m,tile_n", [(64, 32), (16, 16), (32, 64), (16, 128)])
def test_tilings(block_m, tile_n):
    """Tall query tiles (chosen for prefill-heavy batches), key tiles smaller
    and larger than a KV block (block size 32)."""
    specs = [(40, 50), (1, 65), (24, 24)]
    _check(specs, 6, 2, HEAD_DIMS[0], 32, torch.float32, seed=block_m + tile_n,
           block_m=block_m, tile_n=tile_n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype):
    specs = [(1, 21), (6, 40), (1, 33)]
    if CUDA:
        specs += [(512, 1500), (1, 3000)] * 4
    _check(specs, 8, 2, HEAD_DIMS[-1], 16, dtype, seed=3)


def test_decode_only_and_out_argument():
    """Pure decode batch (the G heads of a group share one tile); writes into `out`
    given as a strided view, and leaves the rest of its buffer alone."""
    specs = [(1, n) for n in (5, 16, 17, 31, 64)]
    q, k_cache, v_cache, block_table, qsl, seq_lens = _batch(
        specs, 6, 2, HEAD_DIMS[0], 16, torch.float32, 4)
    buffer = torch.full((q.shape[0], 2 * q.shape[1], q.shape[2]), 7.0, device=DEVICE)
    out = buffer[:, ::2]
    result = paged_attention(q, k_cache, v_cache, block_table, qsl, seq_lens, 0.125, out=out)
    assert result.data_ptr() == out.data_ptr()
    expected = paged_attention_ref(q, k_cache, v_cache, block_table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert (buffer[:, 1::2] == 7.0).all()


def test_rejects_bad_inputs():
    q, k_cache, v_cache, block_table, qsl, seq_lens = _batch(
        [(2, 5)], 6, 4, 16, 16, torch.float32, 6)  # 6 heads over 4 KV heads
    with pytest.raises(AssertionError):
        paged_attention(q, k_cache, v_cache, block_table, qsl, seq_lens, 1.0)
    q, k_cache, v_cache, block_table, qsl, seq_lens = _batch(
        [(2, 5)], 4, 2, 16, 16, torch.float32, 6)
    with pytest.raises(AssertionError):
        paged_attention(q, k_cache, v_cache, block_table.long(), qsl, seq_lens, 1.0)
