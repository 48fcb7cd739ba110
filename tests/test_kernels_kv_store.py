"""KV store by slot mapping: Triton kernel against the per-token reference.

Without CUDA the kernel runs in the Triton interpreter (see test_kernels_bitmask).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from formwork.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, gen, skip=()):
    """Fresh K/V as strided views of a fused qkv buffer, distinct random slots."""
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[list(skip)] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k, v, k_cache, v_cache, slots


def _run_both(k, v, k_cache, v_cache, slots, slot_dtype=torch.int64):
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    dk, dv = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), dk, dv, slots.to(DEVICE, slot_dtype))
    assert torch.equal(dk.cpu(), expected_k)
    assert torch.equal(dv.cpu(), expected_v)
    return expected_k, expected_v


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 64), (4, 128), (2, 96)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_matches_ref(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_dim + block_size)
    num_tokens = 200 if DEVICE == "cuda" else 9
    k, v, k_cache, v_cache, slots = _case(
        num_tokens, num_kv_heads, head_dim, block_size, 16, dtype, gen, skip=(2, 5))
    new_k, _ = _run_both(k, v, k_cache, v_cache, slots)
    # the reference really wrote: stored slots hold k, the others are untouched
    flat_new, flat_old = new_k.view(-1, num_kv_heads, head_dim), k_cache.view(-1, num_kv_heads, head_dim)
    kept = slots >= 0
    assert torch.equal(flat_new[slots[kept]], k[kept])
    untouched = torch.ones(flat_new.shape[0], dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(flat_new[untouched], flat_old[untouched])


def test_int32_slots_and_all_skipped():
    gen = torch.Generator().manual_seed(7)
    k, v, k_cache, v_cache, slots = _case(5, 2, 32, 16, 4, torch.float32, gen)
    _run_both(k, v, k_cache, v_cache, slots, slot_dtype=torch.int32)
    slots[:] = -1
    expected_k, _ = _run_both(k, v, k_cache, v_cache, slots)
    assert torch.equal(expected_k, k_cache)


def test_rejects_mismatched_cache():
    gen = torch.Generator().manual_seed(8)
    k, v, k_cache, v_cache, slots = _case(3, 2, 32, 16, 4, torch.float32, gen)
    with pytest.raises(AssertionError):
        store_kv(k, v, k_cache[..., :16], v_cache[..., :16], slots)
    with pytest.raises(AssertionError):
        store_kv(k, v, k_cache, v_cache.to(torch.bfloat16), slots)
