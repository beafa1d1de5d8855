// XLA FFI CPU kernel: one decode token's attention per row over the paged KV cache
// (kvcache.py's layout), reading only the row's live keys in place.
//
// q [B, K, G, H] f32 (scaled, rotated), pools [P, K, H, S] f32 (positions contiguous within a
// page), table [B, NB] int32 page ids, n_keys [B] int32: row b sees positions
// [max(0, n - window), n) (window 0: no window) -> out [B, K, G, H] f32.
//
// XLA's form of this (kvcache._pages) copies each row's page out of the pool before its two
// dots and runs about ten small kernels per page and layer (~7.5 us for one 128-position page
// at stories260K's head size 8), and every row loops to the longest row's page count.
// Here each (row, kv head) is one task: per page, scores for the G queries in 16-position
// vectors, an online softmax with a vectorized exp, and the value sums.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer::parallel_for;

#ifndef __AVX512F__
#error "attend.cc needs AVX-512 (F)"
#endif

constexpr int kGT = 4;  // queries per register group: the scores of 4 queries share each key load

// e^x in 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact n ln2),
// e^r by Cephes' expf polynomial (relative error ~1e-7), scaled by 2^n with vscalefps. Inputs
// below -104 give 0, as exp does in float32.
INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Lanes of the 16 positions from c that lie in [lo, hi).
INLINE __mmask16 live(int64_t c, int64_t lo, int64_t hi) {
  const uint32_t from = uint32_t(std::clamp<int64_t>(lo - c, 0, 16));
  const uint32_t to = uint32_t(std::clamp<int64_t>(hi - c, 0, 16));
  return __mmask16(((1u << to) - 1) & ~((1u << from) - 1));
}

struct Shape {
  int64_t B, K, G, H, P, S, NB, window;
};

// Row b, kv head k: out[b, k] for its G queries. `work` holds 2 G' H + G' S floats
// (G' = G rounded up to kGT).
void head(const Shape& d, const float* q, const float* pool_k, const float* pool_v,
          const int32_t* table, int64_t b, int64_t k, int64_t n, float* out, float* work) {
  const int64_t G = d.G, H = d.H, S = d.S, Gp = (G + kGT - 1) / kGT * kGT;
  float* qp = work;            // [Gp, H] the queries, zero rows after G
  float* acc = qp + Gp * H;    // [Gp, H] value sums
  float* s = acc + Gp * H;     // [Gp, S] one page's scores, then weights
  float m[64], l[64];          // running max and sum per query (G <= 64, checked)
  std::fill(qp, qp + 2 * Gp * H, 0.0f);
  std::copy(q, q + G * H, qp);
  std::fill(m, m + Gp, -1e30f);
  std::fill(l, l + Gp, 0.0f);
  const int64_t first = d.window > 0 ? std::max<int64_t>(0, n - d.window) : 0;
  for (int64_t j = first / S; j * S < n && j < d.NB; ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, d.P - 1);
    const float* kp = pool_k + (page * d.K + k) * H * S;  // [H, S]
    const float* vp = pool_v + (page * d.K + k) * H * S;
    const int64_t lo = std::max(first, j * S) - j * S, hi = std::min(n, (j + 1) * S) - j * S;
    const int64_t c0 = lo / 16 * 16;
    // scores s[g, c] = q[g] . k[c] for the page's live positions (others: -1e30)
    for (int64_t c = c0; c < hi; c += 16) {
      const __mmask16 valid = live(c, lo, hi);
      for (int64_t g0 = 0; g0 < Gp; g0 += kGT) {
        __m512 sv[kGT];
        for (int t = 0; t < kGT; ++t) sv[t] = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; ++h) {
          const __m512 kv = _mm512_loadu_ps(kp + h * S + c);
          for (int t = 0; t < kGT; ++t)
            sv[t] = _mm512_fmadd_ps(_mm512_set1_ps(qp[(g0 + t) * H + h]), kv, sv[t]);
        }
        for (int t = 0; t < kGT; ++t)
          _mm512_storeu_ps(s + (g0 + t) * S + c,
                           _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), valid, sv[t]));
      }
    }
    // online softmax: new max, rescale the sums, weights exp(s - max) in place
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * S;
      __m512 mx = _mm512_set1_ps(-1e30f);
      for (int64_t c = c0; c < hi; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + c));
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(mx));
      const float scale = std::exp(m[g] - m_new);
      __m512 sum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(m_new);
      for (int64_t c = c0; c < hi; c += 16) {
        const __m512 p =
            _mm512_maskz_mov_ps(live(c, lo, hi), exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + c), mv)));
        _mm512_storeu_ps(sg + c, p);
        sum = _mm512_add_ps(sum, p);
      }
      m[g] = m_new;
      l[g] = l[g] * scale + _mm512_reduce_add_ps(sum);
      for (int64_t h = 0; h < H; ++h) acc[g * H + h] *= scale;
    }
    // value sums acc[g, h] += sum_c w[g, c] v[h, c]
    for (int64_t h = 0; h < H; ++h) {
      const float* vh = vp + h * S;
      for (int64_t g0 = 0; g0 < Gp; g0 += kGT) {
        __m512 pv[kGT];
        for (int t = 0; t < kGT; ++t) pv[t] = _mm512_setzero_ps();
        for (int64_t c = c0; c < hi; c += 16) {
          const __m512 vv = _mm512_maskz_loadu_ps(live(c, lo, hi), vh + c);
          for (int t = 0; t < kGT; ++t)
            pv[t] = _mm512_fmadd_ps(_mm512_loadu_ps(s + (g0 + t) * S + c), vv, pv[t]);
        }
        for (int t = 0; t < kGT; ++t) acc[(g0 + t) * H + h] += _mm512_reduce_add_ps(pv[t]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = 0; h < H; ++h) out[g * H + h] = l[g] > 0 ? acc[g * H + h] / l[g] : 0.0f;
}

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

ffi::Error attend(ffi::ThreadPool pool, F32 q, F32 pool_k, F32 pool_v, S32 table, S32 n_keys,
                  int64_t window, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), pd = pool_k.dimensions(), td = table.dimensions();
  auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2 || !same(pool_v.dimensions(), pd) ||
      n_keys.element_count() != size_t(qd[0]) || td[0] != qd[0] || pd[1] != qd[1] ||
      pd[2] != qd[3] || !same(out->dimensions(), qd))
    return ffi::Error::InvalidArgument(
        "attend: q [B, K, G, H], pools [P, K, H, S], table [B, NB], n_keys [B], out like q");
  const Shape d{qd[0], qd[1], qd[2], qd[3], pd[0], pd[3], td[1], window};
  if (d.G > 64 || d.S % 16)
    return ffi::Error::InvalidArgument("attend: needs G <= 64 queries per kv head and pages of "
                                       "a multiple of 16 positions");
  const float *qp = q.typed_data(), *kp = pool_k.typed_data(), *vp = pool_v.typed_data();
  const int32_t *tp = table.typed_data(), *np_ = n_keys.typed_data();
  float* op = out->typed_data();
  const int64_t Gp = (d.G + kGT - 1) / kGT * kGT, need = 2 * Gp * d.H + Gp * d.S;
  // (row, kv head) tasks; below ~64k key-query products per chunk a hand-off costs more
  int64_t keys = 0;
  for (int64_t b = 0; b < d.B; ++b) keys += std::max<int32_t>(np_[b], 0);
  const int64_t per_task = std::max<int64_t>(1, keys / std::max<int64_t>(1, d.B) * d.G * d.H);
  parallel_for(pool, d.B * d.K, (int64_t{1} << 16) / per_task, [&](int64_t lo, int64_t hi) {
    thread_local std::unique_ptr<float[]> work;
    thread_local int64_t capacity = 0;
    if (capacity < need) work.reset(new float[capacity = need]);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / d.K, k = t % d.K, n = np_[b];
      float* o = op + t * d.G * d.H;
      if (n <= 0) {
        std::fill(o, o + d.G * d.H, 0.0f);
        continue;
      }
      head(d, qp + t * d.G * d.H, kp, vp, tp + b * d.NB, b, k, n, o, work.get());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(attend_f32, attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<S32>()
                                  .Arg<S32>()
                                  .Attr<int64_t>("window")
                                  .Ret<F32>());
