"""Paged decode attention for the CPU serving path, as a small C++ extension.
(Over 300 lines: most of it is the C++ source of the two paths below, kept here
beside its Python launcher, checks and reference.)

One query token per sequence (decode). Sequence `p` attends to keys
`0 .. seq_lens[p] - 1`, read directly from the paged cache through
`block_table[p]`: no gather into a padded copy, no mask. Shapes: q, out
`[P, num_heads, head_dim]`; k_cache, v_cache `[num_blocks, block_size,
num_kv_heads, head_dim]`; block_table `[P, max_blocks]` int32; seq_lens `[P]`
int32. GQA: the G query heads of a KV head share each K/V row loaded.
fp32 / bf16 / fp16 caches; math in fp32 with an online softmax per block.

Two code paths:
- bf16 with head_dim 64 or 128 on an AVX-512 CPU (the served models): one task
  per (sequence, KV head, chunk of <= 4 query heads; <= 2 at head_dim 128), keys
  in tiles of 16. Scores: per key a dot product (AVX512-BF16 `dpbf16ps` on the
  raw bf16 q and K, scale applied after; without AVX512-BF16, K and q widened
  to fp32 by shift/mask), then one 16x16 transpose-and-add gives the tile's 16
  scores in one vector instead of a horizontal reduction per key; softmax on
  that vector (polynomial exp). P.V keeps the chunk's G x D fp32 accumulators
  in registers and loads and widens each V row once for all G heads. While a
  block is computed the next block of the sequence is prefetched, one row per
  key (blocks lie at random places in the cache: the hardware prefetchers do
  not follow, and one burst of prefetches per block stalled behind itself).
- anything else (fp32, fp16, other head_dims, no AVX-512, e.g. AVX2-only):
  the portable loop below (compiler-vectorized, K/V blocks staged in fp32,
  heads one after another); `-DFORMWORK_DECODE_GENERIC` forces it.
Measured on the 2-core Xeon (AVX-512 + BF16), SmolLM2-135M shape (9 q / 3 KV
heads, head_dim 64, block 16, bf16), 48 sequences of 300-900 keys, one layer:
portable path 1.48 ms (15.6 GB/s of KV), fast path 0.80 ms (29 GB/s); with the
data in L2 (compute only) 1.01 -> 0.59 ms. End to end (48 requests, 300-500
token prompts, 400 decode steps) a decode step took ~30% less time (new/old
0.68-0.77, gap growing with context).

Why our own: the torch path (index_select gather + SDPA per padded group) read
and wrote every key twice and padded ragged contexts; profiled on a 2-core
Xeon (bf16, 48 decodes of 100-850 keys) it was ~65% of a decode step. No
maintained CPU paged-attention library installs beside torch 2.13 (IPEX tops
out at torch 2.8; vLLM's CPU kernels come only with vLLM itself).

The extension is built on first use with the machine's C++ compiler
(kernels/cpu_ext.py: ~10 s once, then cached per CPU feature set). If that
fails, `available()` is False and callers keep the torch path.
"""
from __future__ import annotations

import os

import torch

from formwork.kernels.cpu_ext import build
from formwork.kernels.cpu_ext import failure as cpu_ext_failure

_SOURCE = r"""
#include <algorithm>
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


#if defined(__AVX512F__) && !defined(FORMWORK_DECODE_GENERIC)
#include <immintrin.h>
#define FW_FAST 1

static inline __attribute__((always_inline)) __m512 fw_reduce16(const __m512* a) {
  __m512 b[8], c[4], f[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) __m512 fw_exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) void fw_bf16x32(const uint16_t* src, __m512& ev, __m512& od) {
  const __m512i w = _mm512_loadu_si512(src);
  ev = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  od = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Running state of GC query heads: accumulators (even/odd order), max, sum.
template <int D, int GC>
struct FwState {
  alignas(64) float acc[GC][D];
  float m[GC], l[GC];
  void init() {
    for (int g = 0; g < GC; ++g) {
      for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
      m[g] = kNegInf; l[g] = 0.f;
    }
  }
};

template <int BYTES>
static inline __attribute__((always_inline)) void fw_prefetch_row(const uint16_t* row) {
  for (int b = 0; b < BYTES; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// One tile of n <= 16 keys (rows kb, vb with row stride rs) for GC query heads.
// Meanwhile prefetches rows 0 .. pn-1 of pk / pv (the same rows of the sequence's
// next block), one row per key processed: spread out, the prefetches overlap the
// math instead of queueing up behind each other.
template <int D, int GC>
static inline __attribute__((always_inline)) void fw_tile(const uint16_t* qrow, int64_t q_s1,
    const uint16_t* kb, const uint16_t* vb, int64_t rs, int n, float sc, FwState<D, GC>& st,
    const uint16_t* pk, const uint16_t* pv, int pn) {
  constexpr int NC = D / 32, NV = D / 16;
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  alignas(64) float pbuf[GC][16];
  float corr[GC];
  for (int g = 0; g < GC; ++g) {
#ifdef __AVX512BF16__
    __m512bh qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow + g * q_s1 + 32 * c);
#else
    __m512 qe[NC], qo[NC];
    for (int c = 0; c < NC; ++c) fw_bf16x32(qrow + g * q_s1 + 32 * c, qe[c], qo[c]);
#endif
    __m512 a[16];
    for (int j = 0; j < 16; ++j) {
      if (g == 0 && j < pn) fw_prefetch_row<D * 2>(pk + j * rs);
      if (j < n) {
        const uint16_t* kr = kb + j * rs;
#ifdef __AVX512BF16__
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
        for (int c = 1; c < NC; ++c)
          t = _mm512_dpbf16_ps(t, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
#else
        __m512 t = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c) {
          __m512 ke, ko;
          fw_bf16x32(kr + 32 * c, ke, ko);
          t = _mm512_fmadd_ps(qe[c], ke, t);
          t = _mm512_fmadd_ps(qo[c], ko, t);
        }
#endif
        a[j] = t;
      } else {
        a[j] = _mm512_setzero_ps();
      }
    }
    const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNegInf),
                                          _mm512_mul_ps(fw_reduce16(a), _mm512_set1_ps(sc)));
    const float bmax = std::max(st.m[g], _mm512_reduce_max_ps(s));
    const __m512 p = _mm512_maskz_mov_ps(live, fw_exp(_mm512_sub_ps(s, _mm512_set1_ps(bmax))));
    _mm512_store_ps(pbuf[g], p);
    corr[g] = std::exp(st.m[g] - bmax);   // 0 on the first tile (m = kNegInf)
    st.l[g] = st.l[g] * corr[g] + _mm512_reduce_add_ps(p);
    st.m[g] = bmax;
  }
  __m512 acc[GC][NV];
  for (int g = 0; g < GC; ++g) {
    const __m512 cg = _mm512_set1_ps(corr[g]);
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(_mm512_load_ps(st.acc[g] + 16 * v), cg);
  }
  for (int j = 0; j < n; ++j) {
    const uint16_t* vr = vb + j * rs;
    if (j < pn) fw_prefetch_row<D * 2>(pv + j * rs);
    __m512 vv[NV];
    for (int c = 0; c < NC; ++c) fw_bf16x32(vr + 32 * c, vv[2 * c], vv[2 * c + 1]);
    for (int g = 0; g < GC; ++g) {
      const __m512 w = _mm512_set1_ps(pbuf[g][j]);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(w, vv[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(st.acc[g] + 16 * v, acc[g][v]);
}

template <int D, int GC>
static inline void fw_finish(const FwState<D, GC>& st, at::BFloat16* dst, int64_t o_s1) {
  constexpr int NC = D / 32;
  for (int g = 0; g < GC; ++g) {
    const float inv = st.l[g] > 0.f ? 1.f / st.l[g] : 0.f;
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < 16; ++i) {
        dst[g * o_s1 + 32 * c + 2 * i] = static_cast<at::BFloat16>(st.acc[g][32 * c + i] * inv);
        dst[g * o_s1 + 32 * c + 2 * i + 1] = static_cast<at::BFloat16>(st.acc[g][32 * c + 16 + i] * inv);
      }
  }
}

// One task per (sequence, KV head, chunk of <= MAXG of its query heads): the
// chunk's K/V rows are read once per block for all its heads, and the next
// block of the sequence is prefetched while this one is computed (blocks sit at
// random places in the cache, where the hardware prefetchers cannot follow).
template <int D, int GC>
static void fw_seq(const uint16_t* qrow, int64_t q_s1, const uint16_t* kp, const uint16_t* vp,
                   int64_t c_s0, int64_t c_s1, const int32_t* btr, int64_t L, int64_t BS, float sc,
                   at::BFloat16* dst, int64_t o_s1) {
  FwState<D, GC> st;
  st.init();
  for (int64_t start = 0; start < L; start += BS) {
    const int64_t blk = btr[start / BS];
    const int64_t nblk = std::min<int64_t>(BS, L - start);
    const int64_t nxt = start + BS < L ? btr[start / BS + 1] : blk;
    const int64_t npf = start + BS < L ? std::min<int64_t>(BS, L - start - BS) : 0;
    for (int64_t s0 = 0; s0 < nblk; s0 += 16)
      fw_tile<D, GC>(qrow, q_s1, kp + blk * c_s0 + s0 * c_s1, vp + blk * c_s0 + s0 * c_s1, c_s1,
                     static_cast<int>(std::min<int64_t>(16, nblk - s0)), sc, st,
                     kp + nxt * c_s0 + s0 * c_s1, vp + nxt * c_s0 + s0 * c_s1,
                     static_cast<int>(std::clamp<int64_t>(npf - s0, 0, 16)));
  }
  fw_finish<D, GC>(st, dst, o_s1);
}

template <int D>
static void fw_fast(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                    const at::Tensor& bt, const at::Tensor& sl, double scale, at::Tensor& out) {
  constexpr int64_t MAXG = D <= 64 ? 4 : 2;   // GC x D/16 accumulators + one V row fit the 32 registers
  const int64_t P = q.size(0), H = q.size(1);
  const int64_t BS = kc.size(1), KVH = kc.size(2), G = H / KVH, NCH = (G + MAXG - 1) / MAXG;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t c_s0 = kc.stride(0), c_s1 = kc.stride(1), c_s2 = kc.stride(2);
  const int64_t bt_s0 = bt.stride(0);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, P * KVH * NCH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t p = idx / (KVH * NCH), h = (idx / NCH) % KVH, g0 = (idx % NCH) * MAXG;
      const uint16_t* qrow = qp + p * q_s0 + (h * G + g0) * q_s1;
      at::BFloat16* dst = op + p * o_s0 + (h * G + g0) * o_s1;
      const uint16_t* kb = kp + h * c_s2;
      const uint16_t* vb = vp + h * c_s2;
      const int32_t* btr = btp + p * bt_s0;
      const int64_t L = slp[p];
      switch (std::min<int64_t>(MAXG, G - g0)) {
        case 1: fw_seq<D, 1>(qrow, q_s1, kb, vb, c_s0, c_s1, btr, L, BS, sc, dst, o_s1); break;
        case 2: fw_seq<D, 2>(qrow, q_s1, kb, vb, c_s0, c_s1, btr, L, BS, sc, dst, o_s1); break;
        case 3: fw_seq<D, 3>(qrow, q_s1, kb, vb, c_s0, c_s1, btr, L, BS, sc, dst, o_s1); break;
        default: fw_seq<D, 4>(qrow, q_s1, kb, vb, c_s0, c_s1, btr, L, BS, sc, dst, o_s1); break;
      }
    }
  });
}
#endif  // AVX-512 fast path

void paged_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& bt, const at::Tensor& sl, double scale, at::Tensor& out) {
#ifdef FW_FAST
  if (q.scalar_type() == at::kBFloat16) {
    if (q.size(2) == 64) return fw_fast<64>(q, kc, vc, bt, sl, scale, out);
    if (q.size(2) == 128) return fw_fast<128>(q, kc, vc, bt, sl, scale, out);
  }
#endif
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
