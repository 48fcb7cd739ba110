"""Fused elementwise ops of the Llama layer for CUDA, as Triton kernels: the same
four ops and contracts as the CPU extension (kernels/cpu_fused_ops.py, whose
`*_ref` functions are the eager model's code and these kernels' references).

- `rms_norm(x, w, eps)`                 -> w * (x / rms(x))            [T, H]
- `add_rms_norm(x, residual, w, eps)`   residual += x (in place); -> rms_norm(residual)
- `rotary(qkv, positions, cos, sin, h, kvh)` rotates q and k IN PLACE -> views q, k
- `silu_mul(gate_up)`                   -> silu(gate) * up              [T, I]

Why: on an H200 (bench/gpu/step_profile.py, Llama-3-8B shape, batch 32, CUDA
graphs) the torch versions of these took ~1.9 of the decode step's 7.0 GPU ms
(the RMSNorm mean reduction 0.58 ms, casts, adds, the rotary's cat and
products, SiLU): each makes one or more passes over memory. One pass each here.

Numerics follow the references op by op: math in fp32, rounded to the tensor
dtype exactly where torch rounds (after the normalisation, after the weight
product, after each rotary product and their sum, after SiLU and after the
product). Only the mean's summation order differs. CUDA tensors; CPU ones
under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from formwork.kernels._jit import check_launch_device, lazy_jit

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lazy_jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_res, stride_out,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0)
    if ADD:   # residual += x, rounded to its dtype as torch's add_ rounds
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=keep,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=keep)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n
    h = (h * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (h.to(tl.float32) * w.to(tl.float32)).to(x.dtype),
             mask=keep)


@lazy_jit
def _rotary_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_pos,
                   D: tl.constexpr, HALF_P: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)            # q heads then k heads: contiguous in a row
    half = D // 2
    j = tl.arange(0, HALF_P)
    keep = j < half
    pos = tl.load(pos_ptr + t)
    base = qkv_ptr + t * stride_t + head * D
    x1 = tl.load(base + j, mask=keep, other=0.0)
    x2 = tl.load(base + half + j, mask=keep, other=0.0)
    c1 = tl.load(cos_ptr + pos * stride_pos + j, mask=keep, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_pos + half + j, mask=keep, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_pos + j, mask=keep, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_pos + half + j, mask=keep, other=0.0).to(tl.float32)
    dt = x1.dtype
    a1, b1 = x1.to(tl.float32), x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product rounded, then the sum
    o1 = ((a1 * c1).to(dt).to(tl.float32) - (b1 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((b1 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + j, o1, mask=keep)
    tl.store(base + half + j, o2, mask=keep)


@lazy_jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=keep, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=keep, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols,
             (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=keep)


def _rows(t: torch.Tensor) -> None:
    assert t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPES, (t.shape, t.stride(), t.dtype)


def _norm(x, residual, w, eps):
    _rows(x)
    assert w.shape == (x.shape[1],) and w.dtype == x.dtype and w.is_contiguous()
    out = torch.empty_like(x)
    if residual is not None:
        _rows(residual)
        assert residual.shape == x.shape and residual.dtype == x.dtype
    check_launch_device(*(t for t in (x, residual, w, out) if t is not None))
    if x.shape[0]:
        r = residual if residual is not None else x
        _rms_norm_kernel[(x.shape[0],)](
            x, r, w, out, x.shape[1], float(eps), x.stride(0), r.stride(0), out.stride(0),
            ADD=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
            num_warps=min(16, max(1, triton.next_power_of_2(x.shape[1]) // 512)))
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, w, eps)


def add_rms_norm(x, residual, w, eps):
    """residual += x in place (rounded to its dtype); returns (rms_norm(residual), residual)."""
    return _norm(x, residual, w, eps), residual


def rotary(qkv, positions, cos, sin, h: int, kvh: int):
    """Rotates the q and k heads of qkv IN PLACE; returns views q [T, h, D], k [T, kvh, D]."""
    _rows(qkv)
    t, d = qkv.shape[0], cos.shape[1]
    assert qkv.shape[1] >= (h + kvh) * d and d % 2 == 0
    assert cos.dtype == sin.dtype == qkv.dtype and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert positions.shape == (t,) and positions.is_contiguous()
    check_launch_device(qkv, positions, cos, sin)
    if t:
        _rotary_kernel[(t, h + kvh)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0),
                                      D=d, HALF_P=triton.next_power_of_2(d // 2))
    return qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _rows(gate_up)
    assert gate_up.shape[1] % 2 == 0
    inter = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inter)
    check_launch_device(gate_up, out)
    if gate_up.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
