// XLA FFI CPU kernels for quantized matmuls: y[m, o] = sum_i x[m, i] * W[o, i], with W held
// in one of quant.py's FORMATS (parts in FORMATS order, each [O, I / per]) and dequantized in
// registers, so decode reads the compressed blocks once instead of a materialized float weight.
//
// Numerics: float32 activations and float32 (fused multiply-add) accumulation. Each weight is
// dequantized bit-exactly as quant.dequantize / gguf-py compute it: scale products first, then
// one multiply (and add / subtract) per value. That needs -ffp-contract=off (kernels/cpu.py
// builds with it) so that gcc does not fuse `scale * q - low` into one rounding. One-row
// products of the block formats (dot(): decode's matvecs) apply each block's scale and min
// once to the block's sum of q * x instead: within float32 rounding of the same sums.
//
// Work split: output rows in contiguous chunks over XLA's intra-op thread pool (plus the
// calling thread). Up to 8 activation rows: each weight block is read once, dequantized in
// registers and applied to all rows, whose accumulators stay in registers. More rows (prompt
// chunks): each weight row is dequantized once into a small buffer, then multiplied as floats.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer::lanes;
using jaxinfer::parallel_for;
using jaxinfer::slot;
using jaxinfer::static_for;
using jaxinfer::sums16;
// A chunk of rows handed to another thread holds at least kMinChunkRows rows and
// kMinChunkValues weights: below either, the hand-off costs more than it saves.
constexpr int64_t kMinChunkRows = 32, kMinChunkValues = 16384;

#ifndef __AVX512F__
#error "qmatmul.cc needs AVX-512 (F, BW, VL)"
#endif

INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }  // f16 -> f32 is exact

// Hint to load the line holding p[i]. Rows are read as several streams (one per part, two
// rows at a time), which the hardware prefetcher follows poorly: q8_0 decode went from ~10 to
// ~15 GB/s per core with these, 1 KiB ahead. Past the end is harmless (prefetches never fault).
template <class T>
INLINE void pf(const T* p, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// 16 consecutive bytes widened to 16 int32 lanes.
INLINE __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
INLINE __m512i s8x16(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes widened to 8 floats (exact).
INLINE __m256 u8x8f(const uint8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

// *p broadcast to 16 lanes by a load, not a shuffle: written as asm because gcc forwards a
// just-stored float through shuffles (extract, then broadcast from a register), and shuffles
// (vpermps, vpmovzxbd) are what the 4-bit formats are short of.
INLINE __m512 bcast(const float* p) {
  __m512 r;
  asm("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
  return r;
}

INLINE __m512 iota(float base) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_ps(base));
}

// 4- and 5-bit formats dequantize through a table of the 16 (or 32) values a block's (or
// sub-block's) scale can produce: one vpermps per 16 weights instead of convert, multiply
// and subtract. The table entries are computed with the same operations as the reference, so
// the values are the same bits. vpermps reads only the low 4 bits of each index lane, so a
// low nibble needs no mask.
INLINE __m512 lookup(__m512i idx, __m512 table) { return _mm512_permutexvar_ps(idx, table); }
INLINE __m512 lookup32(__m512i idx, __mmask16 high, __m512 lo, __m512 hi) {
  return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx, lo), high, idx, hi);
}

// Each format: kBlock values per block; row(o) -> Row (pointers to row o of every part);
// block(row, b) -> Blk; value<g>(blk) -> the block's dequantized values [16 g, 16 g + 16).

// Q8_0 (32 values): q int8 [O, I], d f16 [O, I / 32]; w = d * q.
struct Q8_0 {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 32;  // blocks to prefetch ahead: 1 KiB of the main stream
  const int8_t* q;
  const uint16_t* d;
  int64_t I;
  struct Row {
    const int8_t* q;
    const uint16_t* d;
  };
  struct Blk {
    const int8_t* q;
    __m512 d;
  };
  INLINE Row row(int64_t o) const { return {q + o * I, d + o * (I / 32)}; }
  INLINE void prefetch(const Row& r, int64_t b) const { pf(r.q, 32 * b), pf(r.d, b); }
  INLINE Blk block(const Row& r, int64_t b) const {
    return {r.q + 32 * b, _mm512_set1_ps(h2f(r.d[b]))};
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    return _mm512_mul_ps(k.d, _mm512_cvtepi32_ps(s8x16(k.q + 16 * G)));
  }
  // One row's product with one activation row: sum_b d[b] (q_b . x_b), the scale applied
  // once per block (as k_dot below; 86M Q8_0 decode 1.17x).
  static constexpr bool kSums = false;
  INLINE float dot(int64_t o, const float* x, const float*) const {
    const Row r = row(o);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < I / 32; ++b) {
      prefetch(r, b + kAhead);
      __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(s8x16(r.q + 32 * b)),
                                  _mm512_loadu_ps(x + 32 * b));
      part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s8x16(r.q + 32 * b + 16)),
                             _mm512_loadu_ps(x + 32 * b + 16), part);
      acc = _mm512_fmadd_ps(_mm512_set1_ps(h2f(r.d[b])), part, acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
};

// Per-channel int8 (any I: the last I % 32 values masked): q int8 [O, I], s f32 [O, 1];
// w = q * s.
struct Int8 {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = true;
  static constexpr int kAhead = 32;  // blocks to prefetch ahead: 1 KiB of the main stream
  const int8_t* q;
  const float* s;
  int64_t I;
  struct Row {
    const int8_t* q;
    __m512 s;
  };
  using Blk = Row;
  INLINE Row row(int64_t o) const { return {q + o * I, _mm512_set1_ps(s[o])}; }
  INLINE void prefetch(const Row& r, int64_t b) const { pf(r.q, 32 * b); }
  INLINE Blk block(const Row& r, int64_t b) const { return {r.q + 32 * b, r.s}; }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(s8x16(k.q + 16 * G)), k.s);
  }
  // Up to 16 of the last I % 32 values, from column col (lanes past them are zero).
  INLINE __m512 tail(const Row& r, int64_t col, __mmask16 valid) const {
    __m128i q8 = _mm_maskz_loadu_epi8(valid, r.q + col);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), r.s);
  }
};

// 16-bit float weights (f16, bf16; any I: the last I % 32 values masked): w [O, I];
// w = float(w), exact.
template <bool kBf16>
struct Half {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = true;
  static constexpr int kAhead = 16;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint16_t* w;
  int64_t I;
  using Row = const uint16_t*;
  using Blk = const uint16_t*;
  INLINE Row row(int64_t o) const { return w + o * I; }
  INLINE void prefetch(const Row& r, int64_t b) const { pf(r, 32 * b); }
  INLINE Blk block(const Row& r, int64_t b) const { return r + 32 * b; }
  static INLINE __m512 widen(__m256i h) {
    if constexpr (kBf16)  // bf16 is the top half of an f32
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 16 * G)));
  }
  INLINE __m512 tail(const Row& r, int64_t col, __mmask16 valid) const {
    return widen(_mm256_maskz_loadu_epi16(valid, r + col));
  }
};

// float32 weights (any I: the last I % 32 values masked): w [O, I]. Small-row products of a
// float model: XLA CPU's dot at 2-8 rows costs 2-3x its one-row time, this tile ~1.2-2x.
struct Full {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = true;
  static constexpr int kAhead = 0;
  const float* w;
  int64_t I;
  using Row = const float*;
  using Blk = const float*;
  INLINE Row row(int64_t o) const { return w + o * I; }
  // No software prefetch: one float stream is what the hardware prefetchers follow best
  // (86M decode's products at one row on huge pages: 28.8 GB/s without, 24.3 with).
  INLINE void prefetch(const Row&, int64_t) const {}
  INLINE Blk block(const Row& r, int64_t b) const { return r + 32 * b; }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    return _mm512_loadu_ps(k + 16 * G);
  }
  INLINE __m512 tail(const Row& r, int64_t col, __mmask16 valid) const {
    return _mm512_maskz_loadu_ps(valid, r + col);
  }
};

// The levels d * (i + base), i in [0, 16), of a block with scale d[b]; plus its min m[b] for
// the formats that have one (kMin): each the reference's product, then its sum.
template <bool kMin>
INLINE __m512 levels(const uint16_t* d, const uint16_t* m, int64_t b, float base) {
  __m512 v = _mm512_mul_ps(_mm512_set1_ps(h2f(d[b])), iota(base));
  if constexpr (kMin) v = _mm512_add_ps(v, _mm512_set1_ps(h2f(m[b])));
  return v;
}

// Q4_0 (32 values): qs [O, I / 2] (byte j: value j low nibble, j + 16 high), d f16;
// w = d * (q - 8). Q4_1 (kMin): plus a min m (f16); w = d * q + m.
template <bool kMin>
struct Q4 {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 64;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // kMin only
  int64_t I;
  struct Row {
    const uint8_t* qs;
    const uint16_t* d;
    const uint16_t* m;
  };
  struct Blk {
    const uint8_t* qs;
    __m512 table;
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), d + o * (I / 32), kMin ? m + o * (I / 32) : nullptr};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    pf(r.qs, 16 * b), pf(r.d, b);
    if constexpr (kMin) pf(r.m, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    return {r.qs + 16 * b, levels<kMin>(r.d, r.m, b, kMin ? 0 : -8)};
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    __m512i z = u8x16(k.qs);
    return lookup(G ? _mm512_srli_epi32(z, 4) : z, k.table);
  }
  // One-row products: block_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
};

// Q5_0 (32 values): qs as Q4_0, qh [O, I / 8] (4 bytes per block: bit j of their
// little-endian u32 is value j's fifth bit), d f16; w = d * (q - 16). Q5_1 (kMin): plus a
// min m; w = d * q + m.
template <bool kMin>
struct Q5 {
  static constexpr int kBlock = 32;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 64;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint8_t* qs;
  const uint8_t* qh;
  const uint16_t* d;
  const uint16_t* m;  // kMin only
  int64_t I;
  struct Row {
    const uint8_t* qs;
    const uint8_t* qh;
    const uint16_t* d;
    const uint16_t* m;
  };
  struct Blk {
    const uint8_t* qs;
    uint32_t high;
    __m512 lo, hi;  // values of q in [0, 16) and [16, 32)
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), qh + o * (I / 8), d + o * (I / 32), kMin ? m + o * (I / 32) : nullptr};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    pf(r.qs, 16 * b), pf(r.qh, 4 * b), pf(r.d, b);
    if constexpr (kMin) pf(r.m, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    uint32_t high;
    std::memcpy(&high, r.qh + 4 * b, 4);
    const float base = kMin ? 0 : -16;
    return {r.qs + 16 * b, high, levels<kMin>(r.d, r.m, b, base),
            levels<kMin>(r.d, r.m, b, base + 16)};
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    __m512i z = u8x16(k.qs);
    return lookup32(G ? _mm512_srli_epi32(z, 4) : z, __mmask16(k.high >> (16 * G)), k.lo, k.hi);
  }
  // One-row products: block_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
};

// The levels of 16 bytes of nibbles as floats, widened once for both halves: lo = the low
// nibbles, hi = the high ones, each plus 16 in the lanes of its fifth-bit mask (kFifth).
template <bool kFifth>
INLINE void nibble_levels(const uint8_t* p, __mmask16 lo5, __mmask16 hi5, __m512& lo,
                          __m512& hi) {
  const __m512i z = u8x16(p);
  __m512i l = _mm512_and_si512(z, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(z, 4);
  if constexpr (kFifth) {
    l = _mm512_mask_or_epi32(l, lo5, l, _mm512_set1_epi32(16));
    h = _mm512_mask_or_epi32(h, hi5, h, _mm512_set1_epi32(16));
  }
  lo = _mm512_cvtepi32_ps(l), hi = _mm512_cvtepi32_ps(h);
}

// One row o of a Q4_0 / Q4_1 / Q5_0 / Q5_1 weight times one activation row x [I], given x's
// sums per block (sums [I / 32]): sum_b d[b] (q_b . x_b) + sum_b c[b] sums[b], where c is the
// block's min (Q4_1, Q5_1) or -8 d (Q4_0; -16 d, Q5_0). As k_dot below: the levels exact
// floats, the 16 bytes widened once for both nibbles, the scale applied once per block.
template <class F>
INLINE float block_dot(const F& f, int64_t o, const float* x, const float* sums) {
  constexpr bool kFifth = !std::is_same_v<F, Q4<false>> && !std::is_same_v<F, Q4<true>>;
  constexpr bool kMin = std::is_same_v<F, Q4<true>> || std::is_same_v<F, Q5<true>>;
  constexpr float kOffset = kFifth ? -16.0f : -8.0f;
  const typename F::Row r = f.row(o);
  __m512 acc = _mm512_setzero_ps();
  float offsets = 0.0f;
  for (int64_t b = 0; b < f.I / 32; ++b) {
    f.prefetch(r, b + F::kAhead);
    uint32_t high = 0;  // bit j: value j's fifth bit
    if constexpr (kFifth) std::memcpy(&high, r.qh + 4 * b, 4);
    __m512 lo, hi;  // values j (low nibbles) and 16 + j (high)
    nibble_levels<kFifth>(r.qs + 16 * b, __mmask16(high), __mmask16(high >> 16), lo, hi);
    __m512 part = _mm512_mul_ps(lo, _mm512_loadu_ps(x + 32 * b));
    part = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 32 * b + 16), part);
    const float d = h2f(r.d[b]);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(d), part, acc);
    offsets += (kMin ? h2f(r.m[b]) : kOffset * d) * sums[b];
  }
  return _mm512_reduce_add_ps(acc) + offsets;
}
template <bool kMin>
INLINE float Q4<kMin>::dot(int64_t o, const float* x, const float* sums) const {
  return block_dot(*this, o, x, sums);
}
template <bool kMin>
INLINE float Q5<kMin>::dot(int64_t o, const float* x, const float* sums) const {
  return block_dot(*this, o, x, sums);
}

// K-quant sub-block scales and mins of one block: scale[j] = d * sc[j], low[j] = dmin * mn[j]
// (8 at once, the reference's products), kept in memory for broadcast loads.
INLINE void k_scales(float* scale, float* low, const uint8_t* sc, const uint8_t* mn, uint16_t d,
                     uint16_t dmin) {
  _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(h2f(d)), u8x8f(sc)));
  _mm256_store_ps(low, _mm256_mul_ps(_mm256_set1_ps(h2f(dmin)), u8x8f(mn)));
}

// Q4_K (256 values, 8 sub-blocks of 32): qs [O, I / 2] (per 64 values, byte l: value l low
// nibble, 32 + l high), sc and mn uint8 [O, I / 32] (6-bit, unpacked at load), d and dmin f16
// [O, I / 256]; w = (d * sc[j]) * q - (dmin * mn[j]) in sub-block j.
struct Q4_K {
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 8;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint8_t* qs;
  const uint8_t* sc;
  const uint8_t* mn;
  const uint16_t* d;
  const uint16_t* dmin;
  int64_t I;
  struct Row {
    const uint8_t *qs, *sc, *mn;
    const uint16_t *d, *dmin;
  };
  struct Blk {
    const uint8_t* qs;
    alignas(32) float scale[8], low[8];  // d * sc[j], dmin * mn[j]
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), sc + o * (I / 32), mn + o * (I / 32), d + o * (I / 256),
            dmin + o * (I / 256)};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    pf(r.qs, 128 * b), pf(r.qs, 128 * b + 64), pf(r.sc, 8 * b), pf(r.mn, 8 * b), pf(r.d, b),
        pf(r.dmin, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    Blk k;
    k.qs = r.qs + 128 * b;
    k_scales(k.scale, k.low, r.sc + 8 * b, r.mn + 8 * b, r.d[b], r.dmin[b]);
    return k;
  }
  // Group g: sub-block j = g / 2, its half g % 2; sub-blocks 2c and 2c + 1 share the 32
  // bytes of chunk c (low and high nibbles). The table of sub-block j is computed for both
  // of its groups; the compiler keeps one copy.
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    constexpr int j = G / 2, h = G % 2, c = j / 2, p = j % 2;
    __m512i z = u8x16(k.qs + 32 * c + 16 * h);
    __m512 table = _mm512_sub_ps(_mm512_mul_ps(bcast(&k.scale[j]), iota(0)), bcast(&k.low[j]));
    return lookup(p ? _mm512_srli_epi32(z, 4) : z, table);
  }
  // One-row products: k_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
};

// Q5_K: Q4_K plus qh [O, I / 8] (32 bytes per block: bit j of byte l is value 32 j + l's
// fifth bit).
struct Q5_K {
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 8;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint8_t* qs;
  const uint8_t* qh;
  const uint8_t* sc;
  const uint8_t* mn;
  const uint16_t* d;
  const uint16_t* dmin;
  int64_t I;
  struct Row {
    const uint8_t *qs, *qh, *sc, *mn;
    const uint16_t *d, *dmin;
  };
  struct Blk {
    const uint8_t *qs, *qh;
    alignas(32) float scale[8], low[8];
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), qh + o * (I / 8), sc + o * (I / 32), mn + o * (I / 32),
            d + o * (I / 256), dmin + o * (I / 256)};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    pf(r.qs, 128 * b), pf(r.qs, 128 * b + 64), pf(r.qh, 32 * b), pf(r.sc, 8 * b),
        pf(r.mn, 8 * b), pf(r.d, b), pf(r.dmin, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    Blk k;
    k.qs = r.qs + 128 * b;
    k.qh = r.qh + 32 * b;
    k_scales(k.scale, k.low, r.sc + 8 * b, r.mn + 8 * b, r.d[b], r.dmin[b]);
    return k;
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    constexpr int j = G / 2, h = G % 2, c = j / 2, p = j % 2;
    __m512i z = u8x16(k.qs + 32 * c + 16 * h);
    // fifth bits of values 32 j + 16 h + [0, 16): bit j of qh bytes 16 h + [0, 16)
    __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k.qh + 16 * h));
    __mmask16 high = _mm_test_epi8_mask(qh, _mm_set1_epi8(char(1 << j)));
    __m512 s = bcast(&k.scale[j]), l = bcast(&k.low[j]);
    __m512 lo = _mm512_sub_ps(_mm512_mul_ps(s, iota(0)), l);
    __m512 hi = _mm512_sub_ps(_mm512_mul_ps(s, iota(16)), l);
    return lookup32(p ? _mm512_srli_epi32(z, 4) : z, high, lo, hi);
  }
  // One-row products: k_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
};

// One row o of a Q4_K or Q5_K weight times one activation row x [I], given x's sums over
// each sub-block (sums [I / 32]): sum_j scale[j] (q_j . x_j) - sum_j low[j] sums[j]. The
// levels q are exact floats, each 16 bytes of nibbles widened once for both their halves,
// and a sub-block's scale waits for its 32 products: no table lookup and no table to build
// per sub-block (a cache-resident q4_k matvec: 1.38 -> 1.02 ns per 16 values; 86M Q4_K
// decode 1.23x). Within float32 rounding of the dequantized weights' products (3e-8 of the
// sum of |terms| measured), not bit-equal to them.
template <class F>
INLINE float k_dot(const F& f, int64_t o, const float* x, const float* sums) {
  constexpr bool kFifth = std::is_same_v<F, Q5_K>;
  const typename F::Row r = f.row(o);
  __m512 acc = _mm512_setzero_ps();
  __m256 mins = _mm256_setzero_ps();
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + F::kAhead);
    alignas(32) float scale[8], low[8];
    k_scales(scale, low, r.sc + 8 * b, r.mn + 8 * b, r.d[b], r.dmin[b]);
    mins = _mm256_fmadd_ps(_mm256_load_ps(low), _mm256_loadu_ps(sums + 8 * b), mins);
    const float* xb = x + 256 * b;
    static_for<4>([&](auto c) {  // bytes [32 c, 32 c + 32): sub-blocks 2c (low), 2c + 1
      __m512 part[2];
      static_for<2>([&](auto h) {  // bytes 16 h + [0, 16): values 16 h + [0, 16) of both
        __mmask16 lo5 = 0, hi5 = 0;
        if constexpr (kFifth) {  // bit j of qh byte l: value 32 j + l's fifth bit
          const __m128i qh =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.qh + 32 * b + 16 * h));
          lo5 = _mm_test_epi8_mask(qh, _mm_set1_epi8(char(1 << (2 * c))));
          hi5 = _mm_test_epi8_mask(qh, _mm_set1_epi8(char(2 << (2 * c))));
        }
        __m512 lv, hv;
        nibble_levels<kFifth>(r.qs + 128 * b + 32 * c + 16 * h, lo5, hi5, lv, hv);
        const float* xs = xb + 64 * c + 16 * h;
        if constexpr (h == 0) {
          part[0] = _mm512_mul_ps(lv, _mm512_loadu_ps(xs));
          part[1] = _mm512_mul_ps(hv, _mm512_loadu_ps(xs + 32));
        } else {
          part[0] = _mm512_fmadd_ps(lv, _mm512_loadu_ps(xs), part[0]);
          part[1] = _mm512_fmadd_ps(hv, _mm512_loadu_ps(xs + 32), part[1]);
        }
      });
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * c]), part[0], acc);
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * c + 1]), part[1], acc);
    });
  }
  const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
  return _mm512_reduce_add_ps(acc) - (m4[0] + m4[1] + m4[2] + m4[3]);
}
INLINE float Q4_K::dot(int64_t o, const float* x, const float* sums) const {
  return k_dot(*this, o, x, sums);
}
INLINE float Q5_K::dot(int64_t o, const float* x, const float* sums) const {
  return k_dot(*this, o, x, sums);
}

// Q6_K (256 values, 16 scale groups of 16): ql [O, I / 2] (per 128 values, byte b: value b
// low nibble, 64 + b high), qh [O, I / 4] (per 128 values, bits 2s..2s+1 of byte l are value
// 32 s + l's top two bits), sc int8 [O, I / 16], d f16 [O, I / 256];
// w = (d * sc[g]) * (q - 32) in group g.
struct Q6_K {
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 8;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* sc;
  const uint16_t* d;
  int64_t I;
  struct Row {
    const uint8_t *ql, *qh;
    const int8_t* sc;
    const uint16_t* d;
  };
  struct Blk {
    alignas(64) int8_t q[256];    // q - 32
    alignas(64) float scale[16];  // d * sc[g]
  };
  INLINE Row row(int64_t o) const {
    return {ql + o * (I / 2), qh + o * (I / 4), sc + o * (I / 16), d + o * (I / 256)};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    pf(r.ql, 128 * b), pf(r.ql, 128 * b + 64), pf(r.qh, 64 * b), pf(r.sc, 16 * b), pf(r.d, b);
  }
  // The block's 6-bit values assembled 64 at a time with byte operations, then widened 16 at
  // a time: a third fewer vector operations than assembling each 16 in 32-bit lanes (a
  // cache-resident q6_k matvec ran 25% faster).
  INLINE Blk block(const Row& r, int64_t b) const {
    Blk k;
    const uint8_t *ql = r.ql + 128 * b, *qh = r.qh + 64 * b;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    for (int H = 0; H < 2; ++H) {  // values [128 H, 128 H + 128)
      __m512i l = _mm512_loadu_si512(ql + 64 * H);
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * H));
      // low nibbles: values 0..63 from the low halves of bytes, 64..127 from the high halves
      __m512i lo = _mm512_and_si512(l, low4), hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
      // top bits of values 32 s + l at shift 2 s of byte l, moved to bits 4..5 (16-bit shifts
      // spill bits into the neighbouring byte, outside the 0x30 kept)
      __m512i top_lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(h, 4)),
                                          _mm256_slli_epi16(h, 2), 1);
      __m512i top_hi =
          _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
      __m512i q_lo = _mm512_ternarylogic_epi32(lo, top_lo, bits45, 0xF8);  // lo | (top & 0x30)
      __m512i q_hi = _mm512_ternarylogic_epi32(hi, top_hi, bits45, 0xF8);
      _mm512_store_si512(k.q + 128 * H, _mm512_sub_epi8(q_lo, _mm512_set1_epi8(32)));
      _mm512_store_si512(k.q + 128 * H + 64, _mm512_sub_epi8(q_hi, _mm512_set1_epi8(32)));
    }
    __m512 sc = _mm512_cvtepi32_ps(s8x16(r.sc + 16 * b));
    _mm512_store_ps(k.scale, _mm512_mul_ps(_mm512_set1_ps(h2f(r.d[b])), sc));
    return k;
  }
  template <int G>
  INLINE __m512 value(const Blk& k) const {
    return _mm512_mul_ps(bcast(&k.scale[G]), _mm512_cvtepi32_ps(s8x16(k.q + 16 * G)));
  }
};

// y[m, o0 + r step] for r < R, m < MT: R weight rows against MT activation rows (x, y already
// offset to the tile's first activation row). step 0 computes and stores one row R times.
template <class F, int R, int MT>
__attribute__((noinline)) void tile(const F& f, const float* x, int64_t I, int64_t O, int64_t o0,
                                    int64_t step, float* y) {
  __m512 acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t o[R];
  typename F::Row row[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = f.row(o[r] = o0 + r * step);
  const int64_t nb = I / F::kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    typename F::Blk blk[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      f.prefetch(row[r], b + F::kAhead);
      blk[r] = f.block(row[r], b);
    }
    const float* xb = x + b * F::kBlock;
    static_for<F::kBlock / 16>([&](auto g) {
      constexpr int G = decltype(g)::value;
      __m512 w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) w[r] = f.template value<G>(blk[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        __m512 xv = _mm512_loadu_ps(xb + m * I + 16 * G);
        // Load x once into a register for all R rows: gcc would fold the load into each FMA,
        // and at one 512-bit load per cycle the loads, not the FMAs, set the pace.
        if constexpr (R > 1) asm("" : "+v"(xv));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(w[r], xv, acc[r][m]);
      }
    });
  }
  if constexpr (F::kTail) {
    for (int64_t col = nb * F::kBlock; col < I; col += 16) {
      __mmask16 valid = lanes(I - col);
      for (int r = 0; r < R; ++r) {
        __m512 w = f.tail(row[r], col, valid);
        for (int m = 0; m < MT; ++m) {
          __m512 xv = _mm512_maskz_loadu_ps(valid, x + m * I + col);
          acc[r][m] = _mm512_fmadd_ps(w, xv, acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) y[m * O + o[r]] = _mm512_reduce_add_ps(acc[r][m]);
}

// Rows o[r] of the weight dequantized into w[r * I, (r + 1) * I).
template <class F, int R>
__attribute__((noinline)) void dequantize(const F& f, const int64_t* o, int64_t I, float* w) {
  for (int r = 0; r < R; ++r) {
    const typename F::Row row = f.row(o[r]);
    float* out = w + r * I;
    const int64_t nb = I / F::kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      f.prefetch(row, b + F::kAhead);
      const typename F::Blk blk = f.block(row, b);
      static_for<F::kBlock / 16>([&](auto g) {
        constexpr int G = decltype(g)::value;
        _mm512_storeu_ps(out + b * F::kBlock + 16 * G, f.template value<G>(blk));
      });
    }
    if constexpr (F::kTail)
      for (int64_t col = nb * F::kBlock; col < I; col += 16) {
        __mmask16 valid = lanes(I - col);
        _mm512_mask_storeu_ps(out + col, valid, f.tail(row, col, valid));
      }
  }
}

// y[m, o[r]] for r < R, m < MT from float weight rows w + r * stride.
template <int R, int MT>
__attribute__((noinline)) void dense(const float* w, int64_t stride, const float* x, int64_t I,
                                     int64_t O, const int64_t* o, float* y) {
  __m512 acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask16 valid) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(valid, w + r * stride + i);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(valid, x + m * I + i);
      asm("" : "+v"(xv));  // one load for all R rows (see tile())
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) step(i, 0xFFFF);
  if (i < I) step(i, lanes(I - i));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) y[m * O + o[r]] = _mm512_reduce_add_ps(acc[r][m]);
}

// y[m, o + r] for r < 4, m < MT <= 4 from float rows w [O, I] (x, y offset to the first
// activation row): sixteen accumulators summed by one sums16. For weights that sit in cache
// (stories260K's, I = 64): per output, a quarter of tile()'s reduction work.
template <int MT>
__attribute__((noinline)) void quad(const float* w, const float* x, int64_t I, int64_t O,
                                    int64_t o, float* y) {
  __m512 acc[16];
  static_for<16>([&](auto n) { acc[n] = _mm512_setzero_ps(); });
  for (int64_t i = 0; i < I; i += 16) {  // one loop with the tail's mask
    const __mmask16 valid = lanes(I - i);
    __m512 wv[4];
    static_for<4>([&](auto r) { wv[r] = _mm512_maskz_loadu_ps(valid, w + (o + r) * I + i); });
    static_for<MT>([&](auto m) {
      __m512 xv = _mm512_maskz_loadu_ps(valid, x + m * I + i);
      asm("" : "+v"(xv));  // one load for all 4 rows (see tile())
      static_for<4>([&](auto r) {
        constexpr int n = slot(r, m);
        acc[n] = _mm512_fmadd_ps(wv[r], xv, acc[n]);
      });
    });
  }
  const __m512 sums = sums16(acc);
  static_for<MT>(
      [&](auto m) { _mm_storeu_ps(y + m * O + o, _mm512_extractf32x4_ps(sums, m)); });
}

// Float weights that fit in L2 (at most kQuadValues) take quad() at 2-8 rows: their rows
// come from cache, so reading four adjacent ones at once costs nothing.
constexpr int64_t kQuadValues = int64_t{1} << 18;

// Formats with a dot(): one-row products go through it (given x's sums per 32 values
// where kSums).
template <class F, class = void>
struct HasDot : std::false_type {};
template <class F>
struct HasDot<F, std::void_t<decltype(&F::dot)>> : std::true_type {};

// Output rows [lo, hi) for all M activation rows.
// M = 1: one weight row at a time, all rows in one sequential stream.
// M = 2..8: two weight rows per tile (halving the loads of x per FMA; loads, not FMAs, were
// the limit at M = 8): rows i and i + half of the range, two sequential streams that the
// prefetchers follow (adjacent rows, 768 B apart and read interleaved, halved q8_0's speed).
// Float weights: four rows per tile, from the quarters (below); from cache, quad().
// M > 8: each row pair dequantized once into a buffer, then plain float tiles of 8
// activation rows over it (fused tiles would dequantize it again for every 8 rows), the
// activation rows in blocks that stay in L2 (512 KiB of x) while the weight passes over
// them: at M = 256, I = 2048, re-reading all of x (2 MiB) from L3 per row pair was slower
// than dequantizing in the graph.
template <class F>
void rows(const F& f, const float* x, int64_t M, int64_t I, int64_t O, int64_t lo, int64_t hi,
          float* y, const float* sums) {
  if (M == 1) {
    if constexpr (HasDot<F>::value)
      for (int64_t o = lo; o < hi; ++o) y[o] = f.dot(o, x, sums);
    else
      for (int64_t o = lo; o < hi; ++o) tile<F, 1, 1>(f, x, I, O, o, 0, y);
    return;
  }
  if constexpr (std::is_same_v<F, Full>)
    if (M <= 8 && O * I <= kQuadValues) {
      int64_t o = lo;
      for (; o + 4 <= hi; o += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const float* xm = x + m0 * I;
          float* ym = y + m0 * O;
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: quad<1>(f.w, xm, I, O, o, ym); break;
            case 2: quad<2>(f.w, xm, I, O, o, ym); break;
            case 3: quad<3>(f.w, xm, I, O, o, ym); break;
            default: quad<4>(f.w, xm, I, O, o, ym); break;
          }
        }
      for (; o < hi; ++o)  // the last rows of an odd range, one weight row at a time
        for (int64_t m = 0; m < M; ++m) tile<F, 1, 1>(f, x + m * I, I, O, o, 0, y + m * O);
      return;
    }
  if constexpr (std::is_same_v<F, Full>)
    if (M <= 8) {
      // Float rows from DRAM at 2-8 rows: four weight rows per tile, from the four quarters
      // of the range (four streams), each against the x rows four at a time, the groups one
      // after the other so that the weight rows come again from L1. A chain of 24 products
      // of 86M shapes (151 MB) at 2 / 4 / 8 rows ran 1.15x / 1.26x / 1.26x faster than with
      // two weight rows per tile (4 rows: 20.7 -> 26.1 GB/s; one row: 22.9 GB/s).
      const int64_t quarter = (hi - lo) / 4;
      auto groups = [&](int64_t o, int64_t step, auto r) {
        constexpr int R = decltype(r)::value;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const float* xm = x + m0 * I;
          float* ym = y + m0 * O;
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: tile<F, R, 1>(f, xm, I, O, o, step, ym); break;
            case 2: tile<F, R, 2>(f, xm, I, O, o, step, ym); break;
            case 3: tile<F, R, 3>(f, xm, I, O, o, step, ym); break;
            default: tile<F, R, 4>(f, xm, I, O, o, step, ym); break;
          }
        }
      };
      using Four = std::integral_constant<int, 4>;
      using One = std::integral_constant<int, 1>;
      for (int64_t o = lo; o < lo + quarter; ++o) groups(o, quarter, Four{});
      for (int64_t o = lo + 4 * quarter; o < hi; ++o) groups(o, 0, One{});  // the last 0-3
      return;
    }
  const int64_t half = (hi - lo + 1) / 2;
  if (M <= 8) {
    for (int64_t o = lo; o < lo + half; ++o) {
      const int64_t step = o + half < hi ? half : 0;  // an odd count's middle row: twice
      switch (M) {
        case 2: tile<F, 2, 2>(f, x, I, O, o, step, y); break;
        case 3: tile<F, 2, 3>(f, x, I, O, o, step, y); break;
        case 4: tile<F, 2, 4>(f, x, I, O, o, step, y); break;
        case 5: tile<F, 2, 5>(f, x, I, O, o, step, y); break;
        case 6: tile<F, 2, 6>(f, x, I, O, o, step, y); break;
        case 7: tile<F, 2, 7>(f, x, I, O, o, step, y); break;
        default: tile<F, 2, 8>(f, x, I, O, o, step, y); break;
      }
    }
    return;
  }
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < 2 * I) buffer.reset(new float[capacity = 2 * I]);
  float* w = buffer.get();
  const int64_t block = std::max<int64_t>(8, (int64_t{512} << 10) / (4 * I) / 8 * 8);
  for (int64_t mb = 0; mb < M; mb += block)
    for (int64_t o = lo; o < lo + half; ++o) {
      const int64_t os[2] = {o, o + half < hi ? o + half : o};
      const float* rows = w;  // the two rows as floats: in place for f32, else dequantized
      int64_t stride = I;
      if constexpr (std::is_same_v<F, Full>)
        rows = f.w + os[0] * I, stride = (os[1] - os[0]) * I;
      else
        dequantize<F, 2>(f, os, I, w);
      for (int64_t m0 = mb; m0 < std::min(M, mb + block); m0 += 8) {
        const float* xm = x + m0 * I;
        float* ym = y + m0 * O;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: dense<2, 1>(rows, stride, xm, I, O, os, ym); break;
          case 2: dense<2, 2>(rows, stride, xm, I, O, os, ym); break;
          case 3: dense<2, 3>(rows, stride, xm, I, O, os, ym); break;
          case 4: dense<2, 4>(rows, stride, xm, I, O, os, ym); break;
          case 5: dense<2, 5>(rows, stride, xm, I, O, os, ym); break;
          case 6: dense<2, 6>(rows, stride, xm, I, O, os, ym); break;
          case 7: dense<2, 7>(rows, stride, xm, I, O, os, ym); break;
          default: dense<2, 8>(rows, stride, xm, I, O, os, ym); break;
        }
      }
    }
}

// One format's parts, in FORMATS order: their dtypes, values per entry (0: one entry per
// weight row), and the format made from their data.
template <class F>
struct Spec;
#define SPEC(F, TYPES, PER, ...)                                                 \
  template <>                                                                    \
  struct Spec<F> {                                                               \
    static constexpr ffi::DataType kTypes[] = {TYPES};                           \
    static constexpr int64_t kPer[] = {PER};                                     \
    static F make(const void* const* p, int64_t I) { return {__VA_ARGS__, I}; } \
  };
#define P(k, T) static_cast<const T*>(p[k])
#define LIST(...) __VA_ARGS__
using ffi::DataType;
SPEC(Q8_0, LIST(DataType::S8, DataType::F16), LIST(1, 32), P(0, int8_t), P(1, uint16_t))
SPEC(Int8, LIST(DataType::S8, DataType::F32), LIST(1, 0), P(0, int8_t), P(1, float))
SPEC(Half<false>, DataType::F16, 1, P(0, uint16_t))
SPEC(Half<true>, DataType::BF16, 1, P(0, uint16_t))
SPEC(Full, DataType::F32, 1, P(0, float))
SPEC(Q4<false>, LIST(DataType::U8, DataType::F16), LIST(2, 32), P(0, uint8_t), P(1, uint16_t),
     nullptr)
SPEC(Q4<true>, LIST(DataType::U8, DataType::F16, DataType::F16), LIST(2, 32, 32),
     P(0, uint8_t), P(1, uint16_t), P(2, uint16_t))
SPEC(Q5<false>, LIST(DataType::U8, DataType::U8, DataType::F16), LIST(2, 8, 32),
     P(0, uint8_t), P(1, uint8_t), P(2, uint16_t), nullptr)
SPEC(Q5<true>, LIST(DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 8, 32, 32), P(0, uint8_t), P(1, uint8_t), P(2, uint16_t), P(3, uint16_t))
SPEC(Q4_K, LIST(DataType::U8, DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 32, 32, 256, 256), P(0, uint8_t), P(1, uint8_t), P(2, uint8_t), P(3, uint16_t),
     P(4, uint16_t))
SPEC(Q5_K,
     LIST(DataType::U8, DataType::U8, DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 8, 32, 32, 256, 256), P(0, uint8_t), P(1, uint8_t), P(2, uint8_t), P(3, uint8_t),
     P(4, uint16_t), P(5, uint16_t))
SPEC(Q6_K, LIST(DataType::U8, DataType::U8, DataType::S8, DataType::F16), LIST(2, 4, 16, 256),
     P(0, uint8_t), P(1, uint8_t), P(2, int8_t), P(3, uint16_t))
#undef SPEC
#undef P
#undef LIST

// y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w for the M rows of [M, I] x, the RMSNorm of
// norm.rms_norm folded into a product's input (the four or five small XLA kernels of a norm
// cost more than the products of a small model's decode step). Its sum runs in 16 lanes, not
// in XLA's order: the result may differ from XLA's norm in the last bit.
void rms_norm(const float* x, const float* w, int64_t M, int64_t I, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * I;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 valid = lanes(I - i);
      const __m512 v = _mm512_maskz_loadu_ps(valid, xm + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / float(I) + eps);
    for (int64_t i = 0; i < I; ++i) y[m * I + i] = xm[i] * r * w[i];
  }
}

// Most weights one call multiplies x by (QKV and gate/up share their input).
constexpr size_t kMaxWeights = 8;

// x [M, I] times W weights (the parts of weight w at [w * P, (w + 1) * P)) -> y_w [M, O_w].
// Their output rows are split over the threads as one range, so that the weights sharing an
// input cost one call and one join: 86M decode's product chain ran 1.08x faster with QKV and
// gate/up each one call.
template <class F>
ffi::Error run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs parts,
               ffi::RemainingRets ys, float eps) {
  using S = Spec<F>;
  constexpr size_t P = std::size(S::kTypes);
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x must be [M, I]");
  const int64_t M = xd[0], I = xd[1];
  if (I % F::kBlock && !F::kTail)
    return ffi::Error::InvalidArgument("qmatmul: I = " + std::to_string(I) +
                                       " is not a multiple of the block");
  const size_t W = ys.size();
  if (W == 0 || W > kMaxWeights || parts.size() != W * P + (eps > 0))
    return ffi::Error::InvalidArgument(
        "qmatmul: expected 1 to 8 results, each with its parts, then the norm weight if eps > 0");
  struct Out {
    F f;
    float* y;
    int64_t O, at;  // its rows, and where they start in the call's range
  };
  Out outs[kMaxWeights];
  int64_t total = 0;
  for (size_t w = 0; w < W; ++w) {
    auto y = ys.get<ffi::AnyBuffer>(w);
    if (!y.has_value()) return y.error();
    auto yd = y.value()->dimensions();
    if (y.value()->element_type() != DataType::F32 || yd.size() != 2 || yd[0] != M)
      return ffi::Error::InvalidArgument("qmatmul: each y must be float32 [M, O]");
    const int64_t O = yd[1];
    const void* p[P];
    for (size_t k = 0; k < P; ++k) {
      auto a = parts.get<ffi::AnyBuffer>(w * P + k);
      if (!a.has_value()) return a.error();
      const int64_t per = S::kPer[k];
      if (a.value().element_type() != S::kTypes[k] ||
          int64_t(a.value().element_count()) != (per ? O * (I / per) : O))
        return ffi::Error::InvalidArgument("qmatmul: a part's dtype or size does not match");
      p[k] = a.value().untyped_data();
    }
    outs[w] = Out{S::make(p, I), y.value()->typed_data<float>(), O, total};
    total += O;
  }
  if (M == 0 || total == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  if (eps > 0) {
    auto w = parts.get<ffi::AnyBuffer>(W * P);
    if (!w.has_value()) return w.error();
    if (w.value().element_type() != DataType::F32 || int64_t(w.value().element_count()) != I)
      return ffi::Error::InvalidArgument("qmatmul: the norm weight must be float32 [I]");
    thread_local std::unique_ptr<float[]> normed;
    thread_local int64_t capacity = 0;
    if (capacity < M * I + 16) normed.reset(new float[capacity = M * I + 16]);
    // 64-byte aligned, as XLA's buffers are: x rows split across cache lines made the 4-row
    // tiles 7% slower at the 86M's shapes
    float* y = normed.get() + (16 - reinterpret_cast<uintptr_t>(normed.get()) / 4 % 16) % 16;
    rms_norm(xp, static_cast<const float*>(w.value().untyped_data()), M, I, eps, y);
    xp = y;  // read by the tasks below, which end before this call returns
  }
  if (I == 0) {
    for (size_t w = 0; w < W; ++w) std::fill(outs[w].y, outs[w].y + M * outs[w].O, 0.0f);
    return ffi::Error::Success();
  }
  const float* sums = nullptr;  // x's sums per 32 values, for a format's one-row dot()
  if constexpr (HasDot<F>::value)
    if (F::kSums && M == 1) {
      thread_local std::unique_ptr<float[]> buffer;
      thread_local int64_t capacity = 0;
      if (capacity < I / 32) buffer.reset(new float[capacity = I / 32]);
      for (int64_t j = 0; j < I / 32; ++j)
        buffer[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xp + 32 * j),
                                                       _mm512_loadu_ps(xp + 32 * j + 16)));
      sums = buffer.get();
    }
  parallel_for(pool, total, std::max(kMinChunkRows, kMinChunkValues / I),
               [&](int64_t lo, int64_t hi) {
                 for (size_t w = 0; w < W; ++w) {
                   const Out& o = outs[w];
                   const int64_t a = std::max(lo, o.at), b = std::min(hi, o.at + o.O);
                   if (a < b) rows(o.f, xp, M, I, o.O, a - o.at, b - o.at, o.y, sums);
                 }
               });
  return ffi::Error::Success();
}

// Bindings: the thread pool, x, the weights' parts (then the norm weight); the results; eps.
auto with() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().RemainingArgs()
      .RemainingRets().Attr<float>("eps");
}

}  // namespace

// The handlers, in QMATMUL_PARTS translation units that kernels/cpu.py compiles in parallel
// (-DQMATMUL_PARTS=n -DQMATMUL_PART=k, each holding every n-th handler) and links into one
// library; without the flags, one unit holds all. (Boilerplate: one block per handler.)
#ifndef QMATMUL_PARTS
#define QMATMUL_PARTS 1
#define QMATMUL_PART 0
#endif
#define PART(i) ((i) % QMATMUL_PARTS == QMATMUL_PART)

#if PART(0)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q4_k, run<Q4_K>, with());
#endif
#if PART(1)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q5_k, run<Q5_K>, with());
#endif
#if PART(2)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q6_k, run<Q6_K>, with());
#endif
#if PART(3)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q8_0, run<Q8_0>, with());
#endif
#if PART(4)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q4_0, run<Q4<false>>, with());
#endif
#if PART(5)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q4_1, run<Q4<true>>, with());
#endif
#if PART(6)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q5_0, run<Q5<false>>, with());
#endif
#if PART(7)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_q5_1, run<Q5<true>>, with());
#endif
#if PART(8)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_int8, run<Int8>, with());
#endif
#if PART(9)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_f16, run<Half<false>>, with());
#endif
#if PART(10)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_bf16, run<Half<true>>, with());
#endif
#if PART(11)
XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_f32, run<Full>, with());
#endif
