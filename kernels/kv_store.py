"""Write new keys/values into the paged KV cache by slot mapping.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; token `t`
goes to `slot_mapping[t] = block * block_size + offset`; slot -1 is skipped
(its K/V are not stored). Slots must not repeat among stored tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formwork.kernels._jit import check_launch_device, lazy_jit


@lazy_jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same shape and strides as k_cache
    slot_ptr,  # [num_tokens] int32/int64
    num_kv_heads,
    head_dim,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    c_stride_b,
    c_stride_o,
    c_stride_h,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (num_tokens,); one program copies one token's K and V, all heads.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # slot -1: no head is in range. (A scalar `& (slot >= 0)` would be simpler,
    # but the triton 3.9 interpreter rejects scalar-and-block boolean masks.)
    heads_in_range = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads < heads_in_range) & (dims < head_dim)
    src_k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask)
    src_v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask)
    dst = block * c_stride_b + offset * c_stride_o + heads * c_stride_h + dims
    tl.store(k_cache_ptr + dst, src_k, mask=mask)
    tl.store(v_cache_ptr + dst, src_v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> caches (mutated); one launch.

    Does not mutate k, v or slot_mapping. CUDA tensors (CPU under the interpreter).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} for k {tuple(k.shape)}"
    )
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    check_launch_device(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: one token at a time."""
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[token]
        v_cache[slot // block_size, slot % block_size] = v[token]
