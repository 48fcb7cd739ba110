"""Unified paged attention over a flat, variable-length batch.

One launch serves a batch that mixes prefill chunks and decodes. Sequence `s`
owns query rows `query_start_loc[s] : query_start_loc[s + 1]` (its `q_len` new
tokens), which are the LAST `q_len` positions of a context of `seq_lens[s]`
tokens whose K/V are already in the paged cache (store_kv runs first). Query at
context position `p` attends causally to keys `0..p`. Key position `k` of
sequence `s` lives in block `block_table[s, k // block_size]`, row
`k % block_size`.

Shapes: q, out `[num_tokens, num_heads, head_dim]`; k_cache, v_cache
`[num_blocks, block_size, num_kv_heads, head_dim]`; block_table
`[num_seqs, max_blocks]` int32; query_start_loc `[num_seqs + 1]` int32;
seq_lens `[num_seqs]` int32. GQA: num_heads is a multiple of num_kv_heads.

Kernel layout (the shape of vLLM's unified Triton attention): a program owns
BLOCK_Q consecutive query positions of one sequence times the G query heads of
one KV head (BLOCK_M = BLOCK_Q * G rows, padded), so each K/V tile loaded
serves all heads of its group; it walks the context in tiles of TILE_N keys
through the block table with an online softmax in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from formwork.kernels._jit import check_launch_device, interpreting, lazy_jit

_LOG2E = 1.4426950408889634


@lazy_jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_seqs, head_dim,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_b, c_stride_o, c_stride_h, bt_stride,
    G: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * G
    BLOCK_Q: tl.constexpr,  # query positions per program
    HEAD_DIM_P: tl.constexpr,  # head_dim rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    TILE_N: tl.constexpr,  # keys per inner iteration
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" for fp32 inputs)
):
    # grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). Program i serves
    # the q-block i - start(s) of the sequence s with start(s) <= i < start(s + 1),
    # start(s) = query_start_loc[s] // BLOCK_Q + s (binary search below).
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = q_block * BLOCK_Q + rows // G  # [BLOCK_M] position among the new tokens
    heads = kv_head * G + rows % G
    row_valid = (rows < BLOCK_Q * G) & (q_pos < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < head_dim
    token = (q_start + q_pos).to(tl.int64)
    q_offs = token[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P]
    query_abs = context_len + q_pos  # [BLOCK_M] context position of each row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    last_key = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # exclusive
    bt_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    for tile in range(0, tl.cdiv(last_key, TILE_N)):
        keys = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        key_valid = keys < seq_len
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offs = block * c_stride_b + (keys % BLOCK_SIZE) * c_stride_o + kv_head * c_stride_h
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k_t = tl.load(k_cache_ptr + kv_offs[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        causal = (keys[None, :] <= query_abs[:, None]) & key_valid[None, :]
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with no key yet
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = token[:, None] * o_stride_t + heads[:, None] * o_stride_h + dims[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_shapes(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out):
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache need equal strides"
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, (cache_head_dim, head_dim)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} not a power of two"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    num_seqs = seq_lens.shape[0]
    assert block_table.dim() == 2 and block_table.shape[0] == num_seqs, block_table.shape
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    for t in (block_table, query_start_loc, seq_lens):
        assert t.dtype == torch.int32, f"index tensors must be int32, got {t.dtype}"
    assert block_table.stride(1) == 1 and query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, "need unit stride on head_dim"
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1


def _tile_config(num_tokens: int, num_seqs: int, group: int, block_size: int) -> tuple[int, int]:
    """(BLOCK_M, TILE_N). 16 rows suit decode (G heads x 1 query); prefill-only
    batches get taller tiles so each loaded K/V tile serves more queries. Decode
    batches take 64 keys per iteration: on an H200 (bench/gpu/kernel_bench.py,
    256 sequences x 4096 keys, 32/8 heads x 128, bf16) 1.09 ms against 1.55 ms
    with 32, i.e. 3.9 of the 4.2 TB/s copy rate."""
    block_m = max(16, triton.next_power_of_2(group))
    if num_tokens >= 4 * num_seqs * 16:  # long query runs on average
        block_m = max(block_m, 64)
    tile_n = 64 if num_tokens <= 2 * num_seqs else 32
    return block_m, max(block_size, tile_n)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Returns out [num_tokens, num_heads, head_dim] (written in place when given).

    Does not mutate its other arguments. CUDA tensors (CPU under the interpreter).
    `block_m` (rows per program, power of two >= 16 and >= heads per KV head)
    and `tile_n` (keys per iteration, power of two >= 16) override the tiling.
    """
    _check_shapes(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    check_launch_device(q, k_cache, v_cache, block_table, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    auto_m, auto_n = _tile_config(num_tokens, num_seqs, group, block_size)
    block_m, tile_n = block_m or auto_m, tile_n or auto_n
    assert block_m >= max(16, group) and block_m & (block_m - 1) == 0, block_m
    assert tile_n >= 16 and tile_n & (tile_n - 1) == 0, tile_n
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens,
        scale * _LOG2E, num_seqs, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        G=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=tile_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if head_dim <= 64 or interpreting() else 8,
    )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: per sequence, gather its context, fp32 einsum + softmax."""
    out = torch.empty_like(q) if out is None else out
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        blocks = block_table[s, : math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        query_pos = torch.arange(seq_len - (b - a), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out
