"""Apply a packed grammar bitmask to logits, in place.

Bitmask layout (the one xgrammar fills): int32 `[num_masked, ceil(vocab / 32)]`;
token `t` of row `i` is allowed when bit `t % 32` of word `t // 32` is 1. Row `i`
applies to `logits[indices[i]]`, or to `logits[i]` when `indices` is None.
Disallowed logits become -inf; bits at or past `logits.shape[1]` are ignored.
A row named twice in `indices` gets both masks (their intersection).

Three implementations, same contract:
- `apply_bitmask_triton`: one Triton launch (CUDA; CPU under TRITON_INTERPRET=1).
- `apply_bitmask_torch`: vectorised torch, the CPU serving path.
- `apply_bitmask_ref`: plain loops, the reference the others are tested against.
`apply_bitmask` picks Triton for CUDA tensors and torch otherwise.
"""

from __future__ import annotations

import sys
import warnings
from typing import Sequence

import torch
import triton
import triton.language as tl

from formwork.kernels._jit import check_launch_device, lazy_jit

Indices = torch.Tensor | Sequence[int] | None

_BLOCK = 1024  # logits per program; a multiple of 32


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices) -> int:
    """Validates shapes; returns the number of masked rows."""
    assert logits.dim() == 2 and bitmask.dim() == 2, (logits.shape, bitmask.shape)
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    assert logits.shape[1] <= 32 * bitmask.shape[1], (
        f"bitmask covers {32 * bitmask.shape[1]} tokens, logits have {logits.shape[1]}"
    )
    num_rows = logits.shape[0] if indices is None else len(indices)
    assert bitmask.shape[0] == num_rows, (
        f"bitmask has {bitmask.shape[0]} rows for {num_rows} logits rows"
    )
    return num_rows


def _as_index_tensor(indices: Indices, device: torch.device) -> torch.Tensor | None:
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        return indices.to(device=device, dtype=torch.int64)
    return torch.tensor(list(indices), dtype=torch.int64, device=device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None) -> None:
    """In place. logits [num_rows, vocab] float; bitmask [num_masked, ceil(vocab/32)] int32."""
    if logits.is_cuda:
        apply_bitmask_triton(logits, bitmask, indices)
    else:
        apply_bitmask_torch(logits, bitmask, indices)


# ---------------------------------------------------------------- Triton

@lazy_jit
def _bitmask_kernel(
    logits_ptr,  # [num_rows, vocab], row stride logits_stride, unit column stride
    bitmask_ptr,  # [num_masked, num_words] int32, row stride bitmask_stride
    indices_ptr,  # [num_masked] int64 target rows (read only when HAS_INDICES)
    vocab,
    num_words,
    logits_stride,
    bitmask_stride,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (num_masked, cdiv(vocab, BLOCK))
    mask_row = tl.program_id(0)
    block = tl.program_id(1)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    words = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(
        bitmask_ptr + mask_row.to(tl.int64) * bitmask_stride + words,
        mask=words < num_words,
        other=-1,
    )
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK // 32, 32]
    blocked = tl.reshape(bits == 0, (BLOCK,))
    cols = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(
        logits_ptr + logits_row * logits_stride + cols,
        float("-inf"),
        mask=blocked & (cols < vocab),
    )


def apply_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None
) -> None:
    """In place, one launch. See the module docstring for the contract."""
    num_rows = _check(logits, bitmask, indices)
    check_launch_device(logits, bitmask)
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "need unit column stride"
    if num_rows == 0:
        return
    index_tensor = _as_index_tensor(indices, logits.device)
    vocab = logits.shape[1]
    grid = (num_rows, triton.cdiv(vocab, _BLOCK))
    _bitmask_kernel[grid](
        logits,
        bitmask,
        index_tensor if index_tensor is not None else bitmask,  # unused placeholder
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=index_tensor is not None,
        BLOCK=_BLOCK,
        num_warps=4,
    )


# ---------------------------------------------------------------- torch

_LUT_CACHE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, k) is +inf when bit k of byte b is set, else -inf."""
    key = (dtype, device)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        lut = torch.where(bits == 1, float("inf"), float("-inf")).to(dtype=dtype, device=device)
        _LUT_CACHE[key] = lut
    return lut


def _unpack_limits(bitmask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_masked, vocab] view: +inf where allowed, -inf where not."""
    assert sys.byteorder == "little", "the byte view below assumes little-endian words"
    # Each int32 word read as 4 little-endian bytes keeps token order: byte j of
    # word w holds tokens 32w + 8j .. 32w + 8j + 7, lowest bit first.
    packed_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int32)  # [n, 4 * words]
    limits = torch.nn.functional.embedding(packed_bytes, _byte_lut(dtype, bitmask.device))
    return limits.view(bitmask.shape[0], -1)[:, :vocab]


def apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None
) -> None:
    """In place, vectorised torch; any device.

    `masked_fill_` with a bool mask is slow on CPU (~10 ns per element); a
    256-entry byte lookup table expanded by `embedding` followed by
    `torch.minimum` is several times faster: min(x, +inf) = x and
    min(x, -inf) = -inf for every non-NaN x. With `indices`, `index_reduce_`
    ("amin") applies the rows in place without gathering logits rows.
    """
    _check(logits, bitmask, indices)
    assert bitmask.device == logits.device, (bitmask.device, logits.device)
    if bitmask.shape[0] == 0:
        return
    limits = _unpack_limits(bitmask, logits.shape[1], logits.dtype)
    if indices is None:
        torch.minimum(logits, limits, out=logits)
        return
    rows = _as_index_tensor(indices, logits.device)
    with warnings.catch_warnings():  # index_reduce_ is marked beta; its semantics fit exactly
        warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
        logits.index_reduce_(0, rows, limits, "amin")


# ---------------------------------------------------------------- reference

def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None) -> None:
    """In place; loops over tokens and bits, for tests."""
    _check(logits, bitmask, indices)
    rows = range(logits.shape[0]) if indices is None else [int(i) for i in indices]
    vocab = logits.shape[1]
    for mask_row, logits_row in enumerate(rows):
        words = bitmask[mask_row].tolist()
        blocked = [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1 == 0]
        logits[logits_row, blocked] = float("-inf")
