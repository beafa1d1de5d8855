// qmatmul's GEMM: a block-format weight [O, I] times many activation rows quantized to 8 bits
// (prompt chunks), as integer products. No float copy of the weight exists: each thread
// unpacks a few of its rows at a time to signed bytes (a block's values as llama.cpp's
// vec_dot multiplies them) plus a scale and a min term per sub-block, and multiplies them with
// every activation row before it unpacks the next ones.
//
// Activations: quantized as llama.cpp does for the weight's format (formats.h's quantize),
// then laid out in panels of 16 rows (vec.h's dp4: lane l is row l, 4 bytes per group), with
// each row's scale (and min term) per sub-block beside them. Each output (m, o) is
//   sum_j scale_w[o, j] scale_x[m, j] (q_w[o, j] . q_x[m, j]) + low_w[o, j] low_x[m, j]
// over the sub-blocks j: llama.cpp's arithmetic with its scales applied per sub-block (float32
// rounding apart). The min terms: Q4_1 / Q5_1 m times Q8_1's s; Q4_K / Q5_K -dmin mn[j] times
// the activations' d sum(q) over the sub-block (Q8_K's bsums).
//
// Work split: output rows over the threads (qmatmul.h's run); each thread unpacks kChunk
// rows (a few hundred KiB, kept in L2), then for each panel multiplies them kTile rows at a
// time, 16 activation rows per register (one int32 sum per sub-block, then a float sum).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "formats.h"
#include "vec.h"

namespace jaxinfer::gemm {

using namespace jaxinfer::vec;
using namespace jaxinfer::formats;

// Unpack<Fmt>: kSub values per scale; kLow: a min term; kFull: values may be -128;
// run(f, row, b, q, scale, low) writes
// block b's values q [kBlock] (signed), scales [kBlock / kSub] and lows.
template <class Fmt>
struct Unpack;

// kFull: values may be -128 (vec.h's dp4); the other formats' lie in [-32, 31].
template <>
struct Unpack<Q8_0> {
  static constexpr int kSub = 32;
  static constexpr bool kLow = false, kFull = true;
  static INLINE void run(const Q8_0&, const Q8_0::Row& r, int64_t b, int8_t* q, float* scale,
                         float*) {
    std::memcpy(q, r.q + 32 * b, 32);
    scale[0] = h2f(r.d[b]);
  }
};

// Q4_0 (q - 8), Q4_1 (q, min m), Q5_0 (q - 16), Q5_1 (q, min m): byte j of qs holds values j
// (low nibble) and 16 + j (high), as nibbles() spreads them.
template <bool kMin>
struct Unpack<Q4<kMin>> {
  static constexpr int kSub = 32;
  static constexpr bool kLow = kMin, kFull = false;
  static INLINE void run(const Q4<kMin>&, const typename Q4<kMin>::Row& r, int64_t b, int8_t* q,
                         float* scale, float* low) {
    S8 v = S8(nibbles(r.qs + 16 * b));
    if constexpr (!kMin) v = v - int8_t(8);
    std::memcpy(q, &v, 32);
    scale[0] = h2f(r.d[b]);
    if constexpr (kMin) low[0] = h2f(r.m[b]);
  }
};
template <bool kMin>
struct Unpack<Q5<kMin>> {  // Q4's, plus the fifth bits (boilerplate)
  static constexpr int kSub = 32;
  static constexpr bool kLow = kMin, kFull = false;
  static INLINE void run(const Q5<kMin>&, const typename Q5<kMin>::Row& r, int64_t b, int8_t* q,
                         float* scale, float* low) {
    uint32_t high;
    std::memcpy(&high, r.qh + 4 * b, 4);
    S8 v = S8(nibbles(r.qs + 16 * b) | bit_bytes(high));
    if constexpr (!kMin) v = v - int8_t(16);
    std::memcpy(q, &v, 32);
    scale[0] = h2f(r.d[b]);
    if constexpr (kMin) low[0] = h2f(r.m[b]);
  }
};

// Q4_K / Q5_K: per 64 values, byte l holds value l (low nibble) and 32 + l (high); Q5_K's bit j
// of qh byte l is value 32 j + l's fifth bit. Sub-block j: scale d sc[j], low -dmin mn[j].
template <class Fmt, bool kFifth>
struct UnpackK {
  static constexpr int kSub = 32;
  static constexpr bool kLow = true, kFull = false;
  static INLINE void run(const Fmt&, const typename Fmt::Row& r, int64_t b, int8_t* q,
                         float* scale, float* low) {
    B32 high{};
    if constexpr (kFifth) high = load32(r.qh + 32 * b);
    static_for<4>([&](auto c) UNROLLED {
      const B32 z = load32(r.qs + 128 * b + 32 * c);
      B32 lo = z & 15, hi = z >> 4;
      if constexpr (kFifth) {
        lo = lo | (((high >> (2 * c)) & 1) << 4);
        hi = hi | (((high >> (2 * c + 1)) & 1) << 4);
      }
      std::memcpy(q + 64 * c, &lo, 32), std::memcpy(q + 64 * c + 32, &hi, 32);
    });
    const float d = h2f(r.d[b]), dmin = h2f(r.dmin[b]);
    for (int j = 0; j < 8; ++j) {
      scale[j] = d * float(r.sc[8 * b + j]);
      low[j] = -(dmin * float(r.mn[8 * b + j]));
    }
  }
};
template <>
struct Unpack<Q4_K> : UnpackK<Q4_K, false> {};
template <>
struct Unpack<Q5_K> : UnpackK<Q5_K, true> {};

// Q6_K: q - 32 in 16 groups of 16, each with scale d sc[g] (Q6_K::block assembles them).
template <>
struct Unpack<Q6_K> {
  static constexpr int kSub = 16;
  static constexpr bool kLow = false, kFull = false;
  static INLINE void run(const Q6_K& f, const Q6_K::Row& r, int64_t b, int8_t* q, float* scale,
                         float*) {
    const Q6_K::Blk k = f.block(r, b);
    std::memcpy(q, k.q, 256), std::memcpy(scale, k.scale, 64);
  }
};

// Activation rows in panels of 16 (dp4's layout): x [P][I / 4][64 bytes], and per row and
// sub-block of kSub values its scale d and min term low [P][I / kSub][16].
struct Panels {
  const uint8_t* x;
  const float* d;
  const float* low;  // formats with a min term only
  int64_t count;     // P
};

// The panels' storage for M rows, in the calling thread's buffers (valid until its next call).
struct PanelBuffers {
  uint8_t* x;
  float *d, *low;
};
inline PanelBuffers panel_buffers(int64_t M, int64_t I, int64_t sub) {
  thread_local std::unique_ptr<uint8_t[]> x;
  thread_local std::unique_ptr<float[]> d;
  thread_local int64_t xcap = 0, dcap = 0;
  const int64_t P = (M + 15) / 16, nx = P * I * 16 + 64, nd = 2 * P * (I / sub) * 16 + 16;
  if (xcap < nx) x.reset(new uint8_t[xcap = nx]);
  if (dcap < nd) d.reset(new float[dcap = nd]);
  // 64-byte aligned: a panel group is one cache line
  uint8_t* xa = x.get() + (64 - reinterpret_cast<uintptr_t>(x.get()) % 64) % 64;
  float* da = d.get() + (16 - reinterpret_cast<uintptr_t>(d.get()) / 4 % 16) % 16;
  return {xa, da, da + P * (I / sub) * 16};
}

// Activation row m (quantized: r) into its panel lane; r null (the last panel's padding past
// M) packs zeros (x + 128 where the panels hold it biased), so their sums are empty.
template <class Fmt>
void pack_row(const Acts* r, int64_t I, int64_t m, const PanelBuffers& out) {
  using U = Unpack<Fmt>;
  constexpr int S = U::kSub;
  const int64_t p = m / 16, l = m % 16, J = I / S;
  uint8_t* x = out.x + p * I * 16 + 4 * l;
  float* d = out.d + p * J * 16 + l;
  float* low = out.low + p * J * 16 + l;
  if (!r) {
    const uint32_t zero = kBiasedX ? 0x80808080u : 0u;
    for (int64_t g = 0; g < I / 4; ++g) std::memcpy(x + 64 * g, &zero, 4);
    for (int64_t j = 0; j < J; ++j) d[16 * j] = 0.0f, low[16 * j] = 0.0f;
    return;
  }
  for (int64_t g = 0; g < I / 4; ++g) {
    uint32_t v;
    std::memcpy(&v, r->q + 4 * g, 4);
    if constexpr (kBiasedX) v ^= 0x80808080u;  // x + 128 as unsigned bytes
    std::memcpy(x + 64 * g, &v, 4);
  }
  constexpr bool kK = Fmt::kActs == Q8::kK;  // one d per 256 values, else per 32
  for (int64_t j = 0; j < J; ++j) {
    const int64_t at = j * S;  // the sub-block's first value
    d[16 * j] = r->d[kK ? at / 256 : at / 32];
    if constexpr (U::kLow) low[16 * j] = r->s[at / 32];
  }
}

// Rows per register tile: NO weight rows against one panel keep NO integer and NO float sums
// of 16 lanes in registers (AVX-512: 8 + 8 of 32 zmm; 16-register sets: 2).
constexpr int kTile = kRegisters >= 32 ? 8 : 2;

// A thread's unpacked rows: values [R / kTile][I / 4][kTile][4] (a tile's rows interleaved
// per 4 values, so that a tile reads its weights from one pointer at fixed offsets: with a
// pointer per row, gcc spent more instructions on addresses than on products; pp512 1.06x),
// and per row and sub-block scale, low and (biased panels) -128 times the values' sum, which
// starts each integer sum.
struct Unpacked {
  int8_t* q;
  float *scale, *low;
  int32_t* start;
};

template <class Fmt>
Unpacked unpack_rows(const Fmt& f, int64_t o, int64_t R, int64_t I) {
  using U = Unpack<Fmt>;
  constexpr int S = U::kSub;
  const int64_t J = I / S;
  thread_local std::unique_ptr<int8_t[]> q, line;
  thread_local std::unique_ptr<float[]> tables;
  thread_local std::unique_ptr<int32_t[]> starts;
  thread_local int64_t qcap = 0, tcap = 0, lcap = 0;
  const int64_t padded = (R + kTile - 1) / kTile * kTile;
  if (qcap < padded * I) q.reset(new int8_t[qcap = padded * I]);
  if (lcap < I) line.reset(new int8_t[lcap = I]);
  if (tcap < R * J) tables.reset(new float[2 * R * J]), starts.reset(new int32_t[R * J]), tcap = R * J;
  Unpacked u{q.get(), tables.get(), tables.get() + R * J, starts.get()};
  for (int64_t r = 0; r < R; ++r) {
    const typename Fmt::Row row = f.row(o + r);
    int8_t* qr = line.get();
    for (int64_t b = 0; b < I / Fmt::kBlock; ++b) {
      f.prefetch(row, b + Fmt::kAhead);
      const int64_t j0 = b * (Fmt::kBlock / S);
      U::run(f, row, b, qr + b * Fmt::kBlock, u.scale + r * J + j0, u.low + r * J + j0);
    }
    if constexpr (kBiasedX)
      for (int64_t j = 0; j < J; ++j) {
        int32_t sum = 0;
        for (int k = 0; k < S; ++k) sum += qr[j * S + k];
        u.start[r * J + j] = -128 * sum;
      }
    int8_t* at = u.q + (r / kTile) * kTile * I + (r % kTile) * 4;  // its lanes in its tile
    for (int64_t g = 0; g < I / 4; ++g) std::memcpy(at + g * 4 * kTile, qr + 4 * g, 4);
  }
  return u;
}

// Output rows o + [0, NO) for the 16 activation rows of panel p (`valid` of them real).
template <class Fmt, int NO>
__attribute__((noinline)) void tile(const Unpacked& u, int64_t r0, const Panels& a, int64_t p,
                                    int64_t I, int64_t valid, int64_t O, int64_t o, float* y) {
  using U = Unpack<Fmt>;
  constexpr int S = U::kSub;
  const int64_t J = I / S;
  const uint8_t* xp = a.x + p * I * 16;
  const float* dp = a.d + p * J * 16;
  const float* lp = U::kLow ? a.low + p * J * 16 : nullptr;
  F acc[NO];
  static_for<NO>([&](auto r) UNROLLED { acc[r] = zero(); });
  for (int64_t j = 0; j < J; ++j) {
    Int sum[NO];
    static_for<NO>([&](auto r) UNROLLED {
      sum[r] = set1i(kBiasedX ? u.start[(r0 + r) * J + j] : 0);
    });
    static_for<S / 4>([&](auto g) UNROLLED {
      const X8 xv = x8(xp + (j * (S / 4) + g) * 64);
      static_for<NO>([&](auto r) UNROLLED {
        int32_t w;
        std::memcpy(&w, u.q + r0 * I + (j * S + 4 * g) * kTile + 4 * r, 4);
        sum[r] = dp4<U::kFull>(sum[r], xv, w);
      });
    });
    const F dv = load(dp + 16 * j);
    static_for<NO>([&](auto r) UNROLLED {
      acc[r] = fma(to_float(sum[r]), dv * u.scale[(r0 + r) * J + j], acc[r]);
    });
    if constexpr (U::kLow) {
      const F lv = load(lp + 16 * j);
      static_for<NO>([&](auto r) UNROLLED {  // a broadcast load (set1: an add, then a shuffle)
        acc[r] = fma(lv, bcast(u.low + (r0 + r) * J + j), acc[r]);
      });
    }
  }
  static_for<NO>([&](auto r) UNROLLED {
    alignas(64) float out[16];
    store(out, acc[r]);
    for (int64_t l = 0; l < valid; ++l) y[(16 * p + l) * O + o + r] = out[l];
  });
}

// Rows the thread unpacks at once: about 256 KiB of values, whole tiles.
inline int64_t chunk_rows(int64_t I) {
  return std::max<int64_t>(kTile, std::min<int64_t>(64, (int64_t{256} << 10) / I) / kTile * kTile);
}

// Output rows [lo, hi) of y [M, O] for all M activation rows in `a`.
template <class Fmt>
void rows(const Fmt& f, const Panels& a, int64_t M, int64_t I, int64_t O, int64_t lo, int64_t hi,
          float* y) {
  const int64_t R = chunk_rows(I);
  for (int64_t c = lo; c < hi; c += R) {
    const int64_t n = std::min(R, hi - c);
    const Unpacked u = unpack_rows(f, c, n, I);
    for (int64_t p = 0; p < a.count; ++p) {
      const int64_t valid = std::min<int64_t>(16, M - 16 * p);
      for (int64_t r0 = 0; r0 < n; r0 += kTile)
        dispatch<kTile>(std::min<int64_t>(kTile, n - r0), [&](auto no) {
          tile<Fmt, decltype(no)::value>(u, r0, a, p, I, valid, O, c + r0, y);
        });
    }
  }
}

}  // namespace jaxinfer::gemm
