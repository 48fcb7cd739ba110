"""Paged decode attention for the CPU serving path, as a small C++ extension.

One query token per sequence (decode). Sequence `p` attends to keys
`0 .. seq_lens[p] - 1`, read directly from the paged cache through
`block_table[p]`: no gather into a padded copy, no mask. Shapes: q, out
`[P, num_heads, head_dim]`; k_cache, v_cache `[num_blocks, block_size,
num_kv_heads, head_dim]`; block_table `[P, max_blocks]` int32; seq_lens `[P]`
int32. GQA: the G query heads of a KV head share each K/V row loaded.
fp32 / bf16 / fp16 caches; math in fp32 with an online softmax per block.

Why our own: the torch path (index_select gather + SDPA per padded group) read
and wrote every key twice and padded ragged contexts; profiled on a 2-core
Xeon (bf16, 48 decodes of 100-850 keys) it was ~65% of a decode step. No
maintained CPU paged-attention library installs beside torch 2.13 (IPEX tops
out at torch 2.8; vLLM's CPU kernels come only with vLLM itself).

The extension is built on first use with the machine's C++ compiler (torch's
cpp_extension + ninja; ~30-60 s once, then cached per CPU feature set). If that
fails, `available()` is False and callers keep the torch path.
"""
from __future__ import annotations

import os

import torch

from formwork.kernels.cpu_ext import build
from formwork.kernels.cpu_ext import failure as cpu_ext_failure

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Finite stand-in for -inf: the build uses -ffast-math (vectorized expf), under
// which infinities are not honoured; exp(kNegInf - x) is still exactly 0.
static constexpr float kNegInf = -1e30f;

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// One row of D values to fp32. bf16 is the top half of an fp32: a shift that
// vectorizes (the generic conversion did not, and dominated the kernel).
template <typename T>
static inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(s[d]) << 16;
}

// HD > 0: head_dim known at compile time (fully unrolled, vectorized loops);
// HD == 0: any head_dim.
template <typename scalar_t, int64_t HD>
static void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& bt, const at::Tensor& sl, double scale, at::Tensor& out) {
  const int64_t P = q.size(0), H = q.size(1), D = HD > 0 ? HD : q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t c_s0 = kc.stride(0), c_s1 = kc.stride(1), c_s2 = kc.stride(2);
  const int64_t bt_s0 = bt.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = kc.data_ptr<scalar_t>();
  const scalar_t* vp = vc.data_ptr<scalar_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, P * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G * BS), kf(BS * D), vf(BS * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t p = idx / KVH, h = idx % KVH;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = qp + p * q_s0 + (h * G + g) * q_s1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(src[d]) * sc;
        m[g] = kNegInf;
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t L = slp[p];
      for (int64_t start = 0; start < L; start += BS) {
        const int64_t n = std::min(BS, L - start);
        const int64_t blk = btp[p * bt_s0 + start / BS];
        const scalar_t* kb = kp + blk * c_s0 + h * c_s2;
        const scalar_t* vb = vp + blk * c_s0 + h * c_s2;
        for (int64_t j = 0; j < n; ++j) {
          load_row(kb + j * c_s1, kf.data() + j * D, D);
          load_row(vb + j * c_s1, vf.data() + j * D, D);
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sg = s.data() + g * BS;
          for (int64_t j = 0; j < n; ++j) {
            const float* kj = kf.data() + j * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kj[d];
            sg[j] = dot;
          }
          float bmax = m[g];
          for (int64_t j = 0; j < n; ++j) bmax = std::max(bmax, sg[j]);
          float lsum = 0.f;
#pragma omp simd reduction(+ : lsum)
          for (int64_t j = 0; j < n; ++j) {
            sg[j] = std::exp(sg[j] - bmax);
            lsum += sg[j];
          }
          const float corr = std::exp(m[g] - bmax);   // 0 on the first block (m = kNegInf)
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          for (int64_t j = 0; j < n; ++j) {
            const float w = sg[j];
            const float* vj = vf.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += w * vj[d];
          }
          m[g] = bmax;
          l[g] = l[g] * corr + lsum;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* dst = op + p * o_s0 + (h * G + g) * o_s1;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& bt, const at::Tensor& sl, double scale, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 64: decode_impl<scalar_t, 64>(q, kc, vc, bt, sl, scale, out); break;
      case 128: decode_impl<scalar_t, 128>(q, kc, vc, bt, sl, scale, out); break;
      default: decode_impl<scalar_t, 0>(q, kc, vc, bt, sl, scale, out);
    }
  });
}
"""

_NAME = "formwork_decode"


def _load():
    if os.environ.get("FORMWORK_CPU_ATTENTION", "").lower() == "torch":
        return None
    return build(_NAME, _SOURCE, ["paged_decode"])


def failure() -> str | None:
    """Why the extension is not available (None when it is)."""
    if os.environ.get("FORMWORK_CPU_ATTENTION", "").lower() == "torch":
        return "disabled by FORMWORK_CPU_ATTENTION=torch"
    return cpu_ext_failure(_NAME)


def available() -> bool:
    """Builds the extension on first call; False if it cannot be built here."""
    return _load() is not None


def _check(q, k_cache, v_cache, block_table, seq_lens, out) -> None:
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    p, h, d = q.shape
    _, _, kvh, dk = k_cache.shape
    assert d == dk and h % kvh == 0, (q.shape, k_cache.shape)
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == p
    assert block_table.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (p,) and seq_lens.is_contiguous()
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    assert all(t.device.type == "cpu" for t in (q, k_cache, v_cache, block_table, seq_lens, out))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """out [P, H, D] (written in place when given). Does not mutate its other
    arguments. Every seq_lens[p] >= 1 and block_table[p] covers it (ids >= 0)."""
    if out is None:
        out = torch.empty_like(q)
    _check(q, k_cache, v_cache, block_table, seq_lens, out)
    module = _load()
    if module is None:
        raise RuntimeError(f"CPU decode-attention extension unavailable: {failure()}")
    if q.shape[0]:
        module.paged_decode(q, k_cache, v_cache, block_table, seq_lens, float(scale), out)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the unified paged-attention reference with one query per sequence."""
    from formwork.kernels.paged_attention import paged_attention_ref

    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention_ref(q, k_cache, v_cache, block_table, qsl, seq_lens, scale, out)
