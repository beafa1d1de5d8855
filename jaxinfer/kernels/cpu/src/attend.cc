// XLA FFI CPU kernel: attention of T tokens per row (a decode step's one, a prompt chunk's
// or a verify step's) over the paged KV cache (kvcache.py's layout), reading the row's live
// keys in place.
//
// q [B, T, K, G, H] f32 (scaled, rotated), the tokens' k, v [B, T, K, H] f32, pools
// [P, K, H, S] f32, f16 or bf16 (positions contiguous within a page; 16-bit pools are widened
// to f32 as they are read and the tokens rounded to nearest even as they are written) or
// q8_0's [P, K, H + 2 nb, S] int8 (ops/kvquant.py: H rows of values, then per block of
// min(32, H) head dims two rows holding its S float16 scales; the tokens quantized as
// llama.cpp's quantize_row_q8_0_ref as they are written), K and V each of its own kind, table
// [B, NB] int32 page ids, start [B] int32 (the first token's position), length [B] (the row's
// real tokens; 0: an idle row, nothing written) -> out [B, T, K, G, H] f32, pools. Token t of
// row b sees positions [max(0, n - window), n), n = min(start + t + 1, start + max(length, 1))
// (window 0: no window; padding tokens t >= length see the row's last key); a row with
// start < 0 gets zeros.
//
// XLA's form of this (kvcache._pages) copies each row's page out of the pool before its two
// dots and runs about ten small kernels per page and layer (~7.5 us for one 128-position page
// at stories260K's head size 8), and every row loops to the longest row's page count.
// Here each (row, kv head) is one task: it writes its head of the row's tokens, then per query
// tile (a token's G heads; in a prompt chunk, about 8 queries of adjacent tokens) and page,
// scores in 16-position vectors, an online softmax with a vectorized exp, and the value sums.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer::parallel_for;
using namespace jaxinfer::vec;
using jaxinfer::static_for;

// Queries per task call: a token's G heads (G <= kMaxQueries), or a tile of a prompt chunk's
// tokens of about kTileQueries queries.
constexpr int64_t kMaxQueries = 64, kTileQueries = 8;

// Lanes of the 16 positions from c that lie in [lo, hi).
INLINE Mask live(int64_t c, int64_t lo, int64_t hi) {
  const uint32_t from = uint32_t(std::clamp<int64_t>(lo - c, 0, 16));
  const uint32_t to = uint32_t(std::clamp<int64_t>(hi - c, 0, 16));
  return ((1u << to) - 1) & ~((1u << from) - 1);
}

// A pool's element type: how 16 positions are read as float32 lanes, how one value is stored,
// its FFI type, its rows per (page, kv head) for heads of H values, and (kScaled) whether
// blocks of block(H) head dims carry per-position scales (q8_0).
struct FloatPool {
  static constexpr bool kScaled = false;
  static int64_t rows(int64_t H) { return H; }
  static int64_t block(int64_t H) { return H; }
};
struct F32Pool : FloatPool {
  using T = float;
  static constexpr ffi::DataType kType = ffi::F32;
  static INLINE F load(const T* p) { return jaxinfer::vec::load(p); }
  static INLINE T store(float x) { return x; }
};
struct F16Pool : FloatPool {
  using T = uint16_t;
  static constexpr ffi::DataType kType = ffi::F16;
  static INLINE F load(const T* p) { return halves(p); }
  static INLINE T store(float x) { return f2h(x); }
};
struct BF16Pool : FloatPool {
  using T = uint16_t;
  static constexpr ffi::DataType kType = ffi::BF16;
  static INLINE F load(const T* p) { return bits_float(u16x16(p) << 16); }  // bf16: f32's top half
  static INLINE T store(float x) {  // round to nearest even; a NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
  }
};
// q8_0: a page's H rows of int8 values, then block b's S float16 scales (2 S bytes) at row
// H + 2 b; a value is q * d.
struct Q8Pool {
  using T = int8_t;
  static constexpr ffi::DataType kType = ffi::S8;
  static constexpr bool kScaled = true;
  static int64_t block(int64_t H) { return std::min<int64_t>(32, H); }
  static int64_t rows(int64_t H) { return H + 2 * (H / block(H)); }
  static INLINE F load(const T* p) { return s8_float(p); }
  // The scales of block b at the 16 positions from c, in a page p of heads of H values.
  static INLINE F scale(const T* p, int64_t H, int64_t b, int64_t S, int64_t c) {
    return halves(reinterpret_cast<const uint16_t*>(p + (H + 2 * b) * S) + c);
  }
};

struct Shape {
  int64_t B, T, K, G, H, P, S, NB, window;
};

// Queries of one (row, kv head) task: Q of them (one token's G heads, or a prompt chunk's
// tile of tokens), query i at q + (i / G) * token + (i % G) * H, seeing positions [lo[i], n[i]).
struct Queries {
  int64_t Q, token;
  const float* q;
  float* out;
  int64_t lo[kMaxQueries], n[kMaxQueries];
};

// Prefetches a page's live positions [0, n): its H rows of values and, in q8_0, its scales.
template <class Pool>
INLINE void fetch_page(const typename Pool::T* p, int64_t H, int64_t S, int64_t n) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < n; c += 16) prefetch(p + h * S, c, 2);
  if constexpr (Pool::kScaled)
    for (int64_t b = 0; b < H / Pool::block(H); ++b)
      for (int64_t c = 0; c < 2 * n; c += 64) prefetch(p + (H + 2 * b) * S, c, 2);
}

// The queries' outputs, GT queries at a time (Q padded with zero queries to Qp, a multiple of
// GT): each page is read once per GT queries, so a prompt chunk's tile of tokens shares the
// page reads a decode step's G heads share. Scores for CB = 4 16-position chunks of GT queries
// at once (8 at GT <= 2: a 128-position page row per pass), value sums for 4 head dims of GT
// queries at once (16 accumulators at GT = 4; an FMA's latency is four of its issue slots).
// Value sums stay 16-lane vectors per (query, head dim) across pages (rescaled with the
// softmax) and are reduced at the end, 16 at a time. A q8_0 pool is read a block of head dims
// at a time: its scores' partial sums times the block's scales added into the scores in
// memory; its value sums take the weights times the block's scales (once per block).
// `work`: Qp H (queries) + 16 (Qp H + 16) (value sums) + 2 Qp S (one page's scores, then
// weights; the weights times a q8_0 V block's scales) floats.
template <class KPool, class VPool, int GT>
void head(const Shape& d, const Queries& qs, const typename KPool::T* kh,
          const typename VPool::T* vh, const int32_t* table, float* work) {
  constexpr int HB = 4;  // head dims per value step
  const int64_t H = d.H, S = d.S, G = d.G, Q = qs.Q, Qp = (Q + GT - 1) / GT * GT;
  // from one page of this head to the next
  const int64_t k_stride = d.K * KPool::rows(H) * S, v_stride = d.K * VPool::rows(H) * S;
  const int64_t kb = KPool::block(H), vb = VPool::block(H);  // head dims per scale (float: H)
  float* qp = work;                      // [Qp, H]
  float* acc = qp + Qp * H;              // [Qp H + 16, 16]: padded to whole sums16 groups
  float* s = acc + (Qp * H + 16) * 16;   // [Qp, S]
  float* sw = s + Qp * S;                // [Qp, S]: weights times a q8_0 V block's scales
  float m[kMaxQueries], l[kMaxQueries];  // running max and sum per query
  // acc is set by the first page; only the vectors past Q H that the last sums16 reads are not
  std::fill(qp, acc, 0.0f);
  std::fill(acc + Q * H * 16, s, 0.0f);
  for (int64_t i = 0; i < Q; ++i)
    std::copy_n(qs.q + (i / G) * qs.token + (i % G) * H, H, qp + i * H);
  std::fill(m, m + Qp, -1e30f);
  std::fill(l, l + Qp, 0.0f);
  const int64_t first = *std::min_element(qs.lo, qs.lo + Q), n = *std::max_element(qs.n, qs.n + Q);
  auto page_of = [&](int64_t j) { return std::clamp<int64_t>(table[j], 0, d.P - 1); };
  // The next page's live keys and values, requested while this page computes: a page is H
  // rows of S positions, which the hardware prefetchers do not run ahead of.
  auto fetch = [&](int64_t j) {
    if (j * S >= n || j >= d.NB) return;
    const int64_t live_n = std::min(S, n - j * S);
    fetch_page<KPool>(kh + page_of(j) * k_stride, H, S, live_n);
    fetch_page<VPool>(vh + page_of(j) * v_stride, H, S, live_n);
  };
  for (int64_t j = first / S, j0 = j; j * S < n && j < d.NB; ++j) {
    fetch(j + 1);
    const typename KPool::T* kp = kh + page_of(j) * k_stride;  // [rows, S]
    const typename VPool::T* vp = vh + page_of(j) * v_stride;
    int64_t lo[kMaxQueries], hi[kMaxQueries];  // each query's live positions in this page
    for (int64_t i = 0; i < Qp; ++i) {
      lo[i] = i < Q ? std::clamp<int64_t>(qs.lo[i] - j * S, 0, S) : 0;
      hi[i] = i < Q ? std::clamp<int64_t>(qs.n[i] - j * S, 0, S) : 0;
    }
    const int64_t c0 = (std::max(first, j * S) - j * S) / 16 * 16;  // whole chunks covering
    const int64_t c1 = (std::min(n, (j + 1) * S) - j * S + 15) / 16 * 16;  // every query's keys
    // scores s[g, c] = q[g] . k[c], CB chunks at a time (masked lanes: -1e30), per block of
    // kb head dims (a float pool's one block: all H)
    auto scores = [&](auto cb, int64_t c, int64_t g0) {
      constexpr int CB = decltype(cb)::value;
      for (int64_t h0 = 0; h0 < H; h0 += kb) {
        F sv[CB][GT];
        static_for<CB>([&](auto i) UNROLLED {
          static_for<GT>([&](auto t) UNROLLED { sv[i][t] = zero(); });
        });
        for (int64_t h = h0; h < h0 + kb; ++h) {
          F qv[GT];
          static_for<GT>([&](auto t) UNROLLED { qv[t] = set1(qp[(g0 + t) * H + h]); });
          static_for<CB>([&](auto i) UNROLLED {
            F kv = KPool::load(kp + h * S + c + 16 * i);
            KEEP(kv);  // one load for the GT queries (gcc would load it per FMA)
            static_for<GT>([&](auto t) UNROLLED { sv[i][t] = fma(qv[t], kv, sv[i][t]); });
          });
        }
        const bool last = h0 + kb == H;
        static_for<CB>([&](auto i) UNROLLED {
          F scale;
          if constexpr (KPool::kScaled) scale = KPool::scale(kp, H, h0 / kb, S, c + 16 * i);
          static_for<GT>([&](auto t) UNROLLED {
            float* to = s + (g0 + t) * S + c + 16 * i;
            F x = sv[i][t];
            if constexpr (KPool::kScaled) x = h0 ? fma(x, scale, load(to)) : x * scale;
            if (last) x = select(live(c + 16 * i, lo[g0 + t], hi[g0 + t]), x, set1(-1e30f));
            store(to, x);
          });
        });
      }
    };
    for (int64_t g0 = 0; g0 < Qp; g0 += GT) {
      int64_t c = c0;
      if constexpr (GT <= 2)  // a whole page row per key load pass: one stream through the page
        for (; c + 128 <= c1; c += 128) scores(std::integral_constant<int, 8>{}, c, g0);
      for (; c + 64 <= c1; c += 64) scores(std::integral_constant<int, 4>{}, c, g0);
      for (; c < c1; c += 16) scores(std::integral_constant<int, 1>{}, c, g0);
    }
    // online softmax: the new max, weights exp(s - max) in place, the sums rescaled
    float scale[kMaxQueries];
    for (int64_t g = 0; g < Qp; ++g) {
      float* sg = s + g * S;
      F mx = set1(-1e30f);
      for (int64_t c = c0; c < c1; c += 16) {
        const F v = load(sg + c);
        mx = where(v > mx, v, mx);
      }
      const float m_new = std::max(m[g], hmax(mx));
      scale[g] = std::exp(m[g] - m_new);
      F sum = zero();
      const F mv = set1(m_new);
      for (int64_t c = c0; c < c1; c += 16) {
        const F e = exp16(load(sg + c) - mv);
        const F p = select(live(c, lo[g], hi[g]), e, zero());
        store(sg + c, p);
        sum = sum + p;
      }
      m[g] = m_new;
      l[g] = l[g] * scale[g] + hsum(sum);
    }
    // value sums acc[g, h] = acc[g, h] * scale[g] + sum_c w[g, c] v[h, c] (16 lanes of c), per
    // block of vb head dims (a float pool's one block: all H)
    for (int64_t b0 = 0; b0 < H; b0 += vb) {
      const float* w_of = s;  // the weights [Qp, S] this block's values take
      if constexpr (VPool::kScaled) {
        for (int64_t c = c0; c < c1; c += 16) {
          const F sc = VPool::scale(vp, H, b0 / vb, S, c);
          for (int64_t g = 0; g < Qp; ++g) store(sw + g * S + c, load(s + g * S + c) * sc);
        }
        w_of = sw;
      }
      for (int64_t g0 = 0; g0 < Qp; g0 += GT)
        for (int64_t h0 = b0; h0 < b0 + vb; h0 += HB) {
          F av[HB][GT];
          static_for<HB>([&](auto u) UNROLLED {
            static_for<GT>([&](auto t) UNROLLED {
              av[u][t] = j == j0 ? zero()
                                 : load(acc + ((g0 + t) * H + h0 + u) * 16) * scale[g0 + t];
            });
          });
          for (int64_t c = c0; c < c1; c += 16) {
            F w[GT];
            static_for<GT>([&](auto t) UNROLLED {
              w[t] = load(w_of + (g0 + t) * S + c);
              KEEP(w[t]);  // loaded once for the HB head dims
            });
            static_for<HB>([&](auto u) UNROLLED {
              F vv = VPool::load(vp + (h0 + u) * S + c);
              KEEP(vv);  // loaded once for the GT queries
              static_for<GT>(
                  [&](auto t) UNROLLED { av[u][t] = fma(w[t], vv, av[u][t]); });
            });
          }
          static_for<HB>([&](auto u) UNROLLED {
            static_for<GT>([&](auto t) UNROLLED {
              store(acc + ((g0 + t) * H + h0 + u) * 16, av[u][t]);
            });
          });
        }
    }
  }
  // out[i, h] = acc[i, h] / l[i]: the (query, head dim) sums 16 at a time, into qp (free now;
  // the last group's spill past it lands in acc's first vector, already read)
  for (int64_t f = 0; f < Q * H; f += 16) {
    F v[16];
    static_for<16>([&](auto u) UNROLLED { v[u] = load(acc + (f + u) * 16); });
    const F sums = sums16(v);
    static_for<4>([&](auto m) UNROLLED {  // lanes 4 m + r: v[slot(r, m)]
      static_for<4>([&](auto r) UNROLLED { qp[f + slot(r, m)] = sums[4 * m + r]; });
    });
  }
  for (int64_t i = 0; i < Q; ++i) {
    float* o = qs.out + (i / G) * qs.token + (i % G) * H;
    for (int64_t h = 0; h < H; ++h) o[h] = l[i] > 0 ? qp[i * H + h] / l[i] : 0.0f;
  }
}

// page[h S + at + i] = src[i stride + h] for h < H, i < n <= 16: n tokens' head (rows
// `stride` apart) into n adjacent positions from `at` of a page. Each store stays in one line:
// a token at a time, the H lines of a page (K and V: 64 KiB at the 86M's heads) had overflowed
// L1 and every store missed. A q8_0 page takes each block of the tokens' values quantized as
// llama.cpp's quantize_row_q8_0_ref does (d = amax / 127, q = roundf(x / d), d = 0: q = 0),
// their scales d in the block's scale rows.
template <class Pool>
__attribute__((noinline)) void columns(const float* src, int64_t stride, typename Pool::T* page,
                                       int64_t at, int64_t n, int64_t H, int64_t S) {
  typename Pool::T* dst = page + at;
  if constexpr (!Pool::kScaled) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) dst[h * S + i] = Pool::store(src[i * stride + h]);
  } else {
    const int64_t bs = Pool::block(H);
    for (int64_t h0 = 0; h0 < H; h0 += bs) {
      uint16_t* scales = reinterpret_cast<uint16_t*>(page + (H + 2 * (h0 / bs)) * S) + at;
      float inv[16];  // 1 / d per token
      for (int64_t i = 0; i < n; ++i) {
        float amax = 0.0f;
        for (int64_t h = h0; h < h0 + bs; ++h) amax = std::max(amax, std::fabs(src[i * stride + h]));
        const float d = amax / 127.0f;
        inv[i] = d != 0.0f ? 1.0f / d : 0.0f;
        scales[i] = f2h(d);
      }
      for (int64_t h = h0; h < h0 + bs; ++h)
        for (int64_t i = 0; i < n; ++i)
          dst[h * S + i] = int8_t(std::round(src[i * stride + h] * inv[i]));
    }
  }
}

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

// A row writes only pages of its own (runtime/pages.py's contract: rows share only cached full
// pages, which no row writes again; idle rows, which share the null page, write nothing), so
// the (row, kv head) tasks never write what another reads. The pools are
// outputs aliased to the inputs (written in place on the donated pools; when XLA hands a
// separate output buffer, the pool is copied into it first).
template <class KPool, class VPool>
ffi::Error attend(ffi::ThreadPool pool, F32 q, F32 k_new, F32 v_new,
                  ffi::Buffer<KPool::kType> pool_k, ffi::Buffer<VPool::kType> pool_v, S32 table,
                  S32 start, S32 length, S32 layer, int64_t window, ffi::ResultBuffer<ffi::F32> out,
                  ffi::ResultBuffer<KPool::kType> pool_k_out,
                  ffi::ResultBuffer<VPool::kType> pool_v_out) {
  auto qd = q.dimensions(), pd = pool_k.dimensions(), td = table.dimensions();
  auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  const size_t B = qd.size() == 5 ? size_t(qd[0]) : 0, T = qd.size() == 5 ? size_t(qd[1]) : 0;
  // stacked pools (depth-shared layers): [copies, P, K, rows, S], read at `layer`
  const size_t lead = pd.size() == 5 ? 1 : 0;
  const int64_t copies = lead ? pd[0] : 1, at = layer.typed_data()[0];
  // the V pool's dims: the K pool's but for its rows
  auto like_k = [&](auto dims, int64_t rows) {
    if (dims.size() != pd.size()) return false;
    for (size_t a = 0; a < dims.size(); ++a)
      if (dims[a] != (a == lead + 2 ? rows : pd[a])) return false;
    return true;
  };
  if (qd.size() != 5 || qd[4] <= 0 || pd.size() != 4 + lead || td.size() != 2 ||
      pd[lead + 2] != KPool::rows(qd[4]) || !same(pool_k_out->dimensions(), pd) ||
      !like_k(pool_v.dimensions(), VPool::rows(qd[4])) ||
      !like_k(pool_v_out->dimensions(), VPool::rows(qd[4])) || start.element_count() != B ||
      length.element_count() != B || td[0] != qd[0] || pd[lead + 1] != qd[2] ||
      !same(out->dimensions(), qd) || k_new.element_count() != B * T * pd[lead + 1] * qd[4] ||
      v_new.element_count() != k_new.element_count() || at < 0 || at >= copies)
    return ffi::Error::InvalidArgument(
        "attend: q [B, T, K, G, H], k_new and v_new [B, T, K, H], pools [P, K, rows, S] (rows: "
        "H, or H + 2 H / min(32, H) in q8_0; or stacked [L, P, K, rows, S] with a layer in "
        "range), table [B, NB], start and length [B], out like q");
  const Shape d{qd[0], qd[1], qd[2], qd[3], qd[4], pd[lead], pd[lead + 3], td[1], window};
  if (d.G > kMaxQueries || d.S % 16 || d.H % 4 || d.H % KPool::block(d.H) ||
      d.H % VPool::block(d.H))
    return ffi::Error::InvalidArgument("attend: needs G <= 64 queries per kv head, head dims "
                                       "a multiple of 4 (of 32 from 32 on in q8_0) and pages "
                                       "of a multiple of 16");
  const int64_t k_rows = KPool::rows(d.H), v_rows = VPool::rows(d.H);
  typename KPool::T* kp = pool_k_out->typed_data();
  typename VPool::T* vp = pool_v_out->typed_data();
  if (kp != pool_k.typed_data()) std::copy_n(pool_k.typed_data(), pool_k.element_count(), kp);
  if (vp != pool_v.typed_data()) std::copy_n(pool_v.typed_data(), pool_v.element_count(), vp);
  kp += at * d.P * d.K * k_rows * d.S, vp += at * d.P * d.K * v_rows * d.S;  // the layer's pools
  const float *qp = q.typed_data(), *kn = k_new.typed_data(), *vn = v_new.typed_data();
  const int32_t *tp = table.typed_data(), *sp = start.typed_data(), *lp = length.typed_data();
  float* op = out->typed_data();
  // tokens per call of head(): one at G >= kTileQueries, else a tile of kTileQueries / G
  const int64_t tile = std::max<int64_t>(1, kTileQueries / d.G);
  const int64_t Qp = (tile * d.G + 3) / 4 * 4, need = 17 * Qp * d.H + 256 + 2 * Qp * d.S;
  // (row, kv head) tasks, in chunks of at least 8k q . k multiply-adds (as many again in the
  // value sums). At 64k, stories260K's 4-row decode step (16 tasks of ~1k at depth 70) ran on
  // one core: 7.8 us per layer, against 4.0 us split in two (at 4k, 5.0 us; at 16k, 6.2 us).
  int64_t keys = 0;
  for (int64_t b = 0; b < d.B; ++b) keys += d.T * (std::max<int32_t>(sp[b], 0) + (d.T + 1) / 2);
  const int64_t per_task = std::max<int64_t>(1, keys / std::max<int64_t>(1, d.B) * d.G * d.H);
  const int64_t token = d.K * d.G * d.H;  // q and out entries per token
  parallel_for(pool, d.B * d.K, (int64_t{1} << 13) / per_task, [&](int64_t lo, int64_t hi) {
    thread_local std::unique_ptr<float[]> work;
    thread_local int64_t capacity = 0;
    if (capacity < need) work.reset(new float[capacity = need]);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / d.K, k = task % d.K, first = sp[b];
      typename KPool::T* kh = kp + k * k_rows * d.S;
      typename VPool::T* vh = vp + k * v_rows * d.S;
      const int64_t real = first >= 0 ? std::min<int64_t>(lp[b], d.T) : 0;
      for (int64_t t = 0, n; t < real; t += n) {
        // this task's head of the row's tokens [t, t + n), at their positions in one page
        const int64_t pos = first + t, j = std::min(pos / d.S, d.NB - 1);
        n = std::min({real - t, d.S - pos % d.S, int64_t{16}});
        const int64_t page = std::clamp<int64_t>(tp[b * d.NB + j], 0, d.P - 1) * d.K * d.S;
        const int64_t from = ((b * d.T + t) * d.K + k) * d.H;
        columns<KPool>(kn + from, d.K * d.H, kh + page * k_rows, pos % d.S, n, d.H, d.S);
        columns<VPool>(vn + from, d.K * d.H, vh + page * v_rows, pos % d.S, n, d.H, d.S);
      }
      const int64_t last = first + std::max<int32_t>(lp[b], 1);  // past the row's last key
      for (int64_t t0 = 0; t0 < d.T; t0 += tile) {
        const int64_t at = (b * d.T + t0) * token + k * d.G * d.H;
        const int64_t tokens = std::min(tile, d.T - t0);
        if (first < 0) {
          for (int64_t t = 0; t < tokens; ++t)
            std::fill_n(op + at + t * token, d.G * d.H, 0.0f);
          continue;
        }
        Queries qs;  // lo and n set below for the Q queries only
        qs.Q = tokens * d.G, qs.token = token, qs.q = qp + at, qs.out = op + at;
        for (int64_t i = 0; i < qs.Q; ++i) {
          qs.n[i] = std::min(first + t0 + i / d.G + 1, last);
          qs.lo[i] = d.window > 0 ? std::max<int64_t>(0, qs.n[i] - d.window) : 0;
        }
        if (qs.Q == 1)
          head<KPool, VPool, 1>(d, qs, kh, vh, tp + b * d.NB, work.get());
        else if (qs.Q == 2)
          head<KPool, VPool, 2>(d, qs, kh, vh, tp + b * d.NB, work.get());
        else
          head<KPool, VPool, 4>(d, qs, kh, vh, tp + b * d.NB, work.get());
      }
    }
  });
  return ffi::Error::Success();
}

// One handler per (K pool, V pool) kind pair the engine registers (kernels/cpu/__init__.py's
// ATTEND_PAIRS); past the first argument of a dependent type the chain is dependent, hence
// `.template`.
template <class KPool, class VPool>
auto bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<F32>()                                           // q
      .Arg<F32>()                                           // k_new
      .Arg<F32>()                                           // v_new
      .Arg<ffi::Buffer<KPool::kType>>()                     // pool_k
      .template Arg<ffi::Buffer<VPool::kType>>()            // pool_v
      .template Arg<S32>()                                  // table
      .template Arg<S32>()                                  // start
      .template Arg<S32>()                                  // length
      .template Arg<S32>()                                  // layer (int32 []: 0 unless stacked)
      .template Attr<int64_t>("window")
      .template Ret<F32>()                                  // out
      .template Ret<ffi::Buffer<KPool::kType>>()            // pool_k
      .template Ret<ffi::Buffer<VPool::kType>>();           // pool_v
}

}  // namespace

// The library's instruction set (vec.h), read by kernels/cpu/.
extern "C" const char* jaxinfer_variant() { return jaxinfer::kVariant; }

// attend_<K>[_<V>]: the pools' kinds, V's only where it differs from K's.
#define JAXINFER_ATTEND(name, KPool, VPool) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (attend<KPool, VPool>), (bind<KPool, VPool>()))
JAXINFER_ATTEND(attend_f32, F32Pool, F32Pool);
JAXINFER_ATTEND(attend_f16, F16Pool, F16Pool);
JAXINFER_ATTEND(attend_bf16, BF16Pool, BF16Pool);
JAXINFER_ATTEND(attend_q8_0, Q8Pool, Q8Pool);
JAXINFER_ATTEND(attend_q8_0_f32, Q8Pool, F32Pool);
JAXINFER_ATTEND(attend_q8_0_f16, Q8Pool, F16Pool);
JAXINFER_ATTEND(attend_q8_0_bf16, Q8Pool, BF16Pool);
JAXINFER_ATTEND(attend_f32_q8_0, F32Pool, Q8Pool);
JAXINFER_ATTEND(attend_f16_q8_0, F16Pool, Q8Pool);
JAXINFER_ATTEND(attend_bf16_q8_0, BF16Pool, Q8Pool);
