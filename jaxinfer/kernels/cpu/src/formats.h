// The weight formats of qmatmul: how a row of each of quant.py's FORMATS is read and
// dequantized, 16 values at a time, with the vector API of vec.h (one source for every
// instruction set).
//
// Each format: kBlock values per block; row(o) -> Row (pointers to row o of every part);
// block(row, b) -> Blk; value<g>(blk) -> the block's dequantized values [16 g, 16 g + 16);
// formats whose rows may end inside a block (kTail) also tail(row, col, valid) for the last
// values. Formats with a one-row dot() give decode's matvecs a cheaper form (below). The
// structs repeat this interface's members, each with its own parts (boilerplate, marked
// where each struct opens).
//
// Numerics: each weight is dequantized bit-exactly as quant.dequantize / gguf-py compute it:
// scale products first, then one multiply (and add / subtract) per value. That needs
// -ffp-contract=off (kernels/cpu/build.py builds with it) so that gcc does not fuse
// `scale * q - low` into one rounding; the accumulations' FMAs are explicit (vec::fma).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace jaxinfer::formats {

using namespace jaxinfer::vec;

// The levels d * (i + base), i in [0, 16), of a block with scale d[b]; plus its min m[b] for
// the formats that have one (kMin): each the reference's product, then its sum.
//
// 4- and 5-bit formats dequantize through such a table of the 16 (or 32) values a block's
// (or sub-block's) scale can produce: one permute per 16 weights instead of convert,
// multiply and subtract where the instruction set has one (vec::lookup). The table entries
// are computed with the same operations as the reference, so the values are the same bits.
template <bool kMin>
INLINE F levels(const uint16_t* d, const uint16_t* m, int64_t b, float base) {
  F v = set1(h2f(d[b])) * iota(base);
  if constexpr (kMin) v = v + h2f(m[b]);
  return v;
}

// ---- 8-bit activations ----
// A product's activation row quantized to 8 bits as llama.cpp quantizes it for the weight's
// format (its vec_dot_type), so that the integer products are llama.cpp's: Q8_0 (blocks of 32,
// d = max|x| / 127 rounded to f16, q = x * (127 / max|x|) rounded to nearest even) for Q8_0,
// Q4_0 and Q5_0; Q8_1 (Q8_0 plus s = f16(d * sum q)) for Q4_1 and Q5_1; Q8_K (blocks of 256,
// iscale = -127 / the value of largest magnitude, q = min(127, round(iscale x)), float
// d = 1 / iscale) for the K-quants. ops/quant.py's quantize_activations is the same in jnp.
enum class Q8 { k0, k1, kK };
struct Acts {        // one activation row of I values
  const int8_t* q;   // [I]
  const float* d;    // [I / 32] (Q8_0, Q8_1) or [I / 256] (Q8_K)
  const float* s;    // [I / 32]: Q8_1's s; Q8_K's d times the sum of q per 32 values
};

// llama.cpp's nearest_int: round to nearest even for |v| < 2^22.
INLINE int32_t nearest(float v) {
  const float f = v + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &f, 4);
  return (i & 0x007FFFFF) - 0x00400000;
}

// x [I] quantized into q [I], d and s (each at least I / 32 entries); returns the row.
inline Acts quantize(Q8 kind, const float* x, int64_t I, int8_t* q, float* d, float* s) {
  if (kind == Q8::kK) {
    for (int64_t b = 0; b < I / 256; ++b) {
      const float* xb = x + 256 * b;
      float amax = 0.0f, max = 0.0f;
      for (int j = 0; j < 256; ++j)
        if (std::fabs(xb[j]) > amax) amax = std::fabs(xb[j]), max = xb[j];
      const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
      for (int j = 0; j < 256; ++j) {
        const int32_t v = nearest(iscale * xb[j]);
        q[256 * b + j] = int8_t(v < 127 ? v : 127);
      }
      d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
      for (int j = 0; j < 8; ++j) {
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[256 * b + 32 * j + i];
        s[8 * b + j] = d[b] * float(sum);  // the min terms' activation side (llama.cpp's bsums)
      }
    }
    return {q, d, s};
  }
  for (int64_t b = 0; b < I / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float db = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q[32 * b + j] = int8_t(nearest(xb[j] * id));
    d[b] = h2f(f2h(db));
    if (kind == Q8::k1) s[b] = h2f(f2h(db * float(sum)));
  }
  return {q, d, s};
}

// Q8_0 (32 values): q int8 [O, I], d f16 [O, I / 32]; w = d * q.
struct Q8_0 {  // the format interface (boilerplate)
  static constexpr int kBlock = 32;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 128;  // blocks to prefetch ahead: 4 KiB of the main stream
  const int8_t* q;
  const uint16_t* d;
  int64_t I;
  struct Row {
    const int8_t* q;
    const uint16_t* d;
  };
  struct Blk {
    const int8_t* q;
    F d;
  };
  INLINE Row row(int64_t o) const { return {q + o * I, d + o * (I / 32)}; }
  INLINE void prefetch(const Row& r, int64_t b) const {
    vec::prefetch(r.q, 32 * b), vec::prefetch(r.d, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const { return {r.q + 32 * b, set1(h2f(r.d[b]))}; }
  template <int G>
  INLINE F value(const Blk& k) const {
    return k.d * to_float(s8x16(k.q + 16 * G));
  }
  // One row's product with one activation row: sum_b d[b] (q_b . x_b), the scale applied
  // once per block (as k_dot below; 86M Q8_0 decode 1.17x on AVX-512).
  static constexpr bool kSums = false;
  INLINE float dot(int64_t o, const float* x, const float*) const {
    const Row r = row(o);
    F acc = zero();
    for (int64_t b = 0; b < I / 32; ++b) {
      prefetch(r, b + kAhead);
      F part = to_float(s8x16(r.q + 32 * b)) * load(x + 32 * b);
      part = fma(to_float(s8x16(r.q + 32 * b + 16)), load(x + 32 * b + 16), part);
      acc = fma(set1(h2f(r.d[b])), part, acc);
    }
    return hsum(acc);
  }
  static constexpr Q8 kActs = Q8::k0;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// Per-channel int8 (any I: the last I % 32 values masked): q int8 [O, I], s f32 [O, 1];
// w = q * s.
struct Int8 {  // the format interface (boilerplate)
  static constexpr int kBlock = 32;
  static constexpr bool kTail = true;
  static constexpr int kAhead = 32;  // blocks to prefetch ahead: 1 KiB of the main stream
  const int8_t* q;
  const float* s;
  int64_t I;
  struct Row {
    const int8_t* q;
    F s;
  };
  using Blk = Row;
  INLINE Row row(int64_t o) const { return {q + o * I, set1(s[o])}; }
  INLINE void prefetch(const Row& r, int64_t b) const { vec::prefetch(r.q, 32 * b); }
  INLINE Blk block(const Row& r, int64_t b) const { return {r.q + 32 * b, r.s}; }
  template <int G>
  INLINE F value(const Blk& k) const {
    return to_float(s8x16(k.q + 16 * G)) * k.s;
  }
  // Up to 16 of the last I % 32 values, from column col (lanes past them are zero).
  INLINE F tail(const Row& r, int64_t col, Mask valid) const {
    return to_float(s8x16_n(r.q + col, valid)) * r.s;
  }
};

// 16-bit float weights (f16, bf16; any I: the last I % 32 values masked): w [O, I];
// w = float(w), exact.
template <bool kBf16>
struct Half {  // the format interface (boilerplate)
  static constexpr int kBlock = 32;
  static constexpr bool kTail = true;
  static constexpr int kAhead = 16;  // blocks to prefetch ahead: 1 KiB of the main stream
  const uint16_t* w;
  int64_t I;
  using Row = const uint16_t*;
  using Blk = const uint16_t*;
  INLINE Row row(int64_t o) const { return w + o * I; }
  INLINE void prefetch(const Row& r, int64_t b) const { vec::prefetch(r, 32 * b); }
  INLINE Blk block(const Row& r, int64_t b) const { return r + 32 * b; }
  template <int G>
  INLINE F value(const Blk& k) const {
    if constexpr (kBf16)  // bf16 is the top half of an f32
      return bits_float(u16x16(k + 16 * G) << 16);
    else
      return halves(k + 16 * G);
  }
  INLINE F tail(const Row& r, int64_t col, Mask valid) const {
    if constexpr (kBf16)
      return bits_float(u16x16_n(r + col, valid) << 16);
    else
      return halves_n(r + col, valid);
  }
};

// float32 weights (any I: the last I % 32 values masked): w [O, I]. Small-row products of a
// float model: XLA CPU's dot at 2-8 rows costs 2-3x its one-row time, this tile ~1.2-2x.
struct Full {  // the format interface (boilerplate)
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
  INLINE F value(const Blk& k) const {
    return load(k + 16 * G);
  }
  INLINE F tail(const Row& r, int64_t col, Mask valid) const { return load_n(r + col, valid); }
};

// Q4_0 (32 values): qs [O, I / 2] (byte j: value j low nibble, j + 16 high), d f16;
// w = d * (q - 8). Q4_1 (kMin): plus a min m (f16); w = d * q + m.
template <bool kMin>
struct Q4 {  // the format interface (boilerplate)
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
    F table;
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), d + o * (I / 32), kMin ? m + o * (I / 32) : nullptr};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    vec::prefetch(r.qs, 16 * b), vec::prefetch(r.d, b);
    if constexpr (kMin) vec::prefetch(r.m, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    return {r.qs + 16 * b, levels<kMin>(r.d, r.m, b, kMin ? 0 : -8)};
  }
  template <int G>
  INLINE F value(const Blk& k) const {
    const Int z = u8x16(k.qs);
    return lookup(G ? z >> 4 : z, k.table);
  }
  // One-row products: block_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
  static constexpr Q8 kActs = kMin ? Q8::k1 : Q8::k0;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// Q5_0 (32 values): qs as Q4_0, qh [O, I / 8] (4 bytes per block: bit j of their
// little-endian u32 is value j's fifth bit), d f16; w = d * (q - 16). Q5_1 (kMin): plus a
// min m; w = d * q + m.
template <bool kMin>
struct Q5 {  // the format interface (boilerplate)
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
    F lo, hi;  // values of q in [0, 16) and [16, 32)
  };
  INLINE Row row(int64_t o) const {
    return {qs + o * (I / 2), qh + o * (I / 8), d + o * (I / 32), kMin ? m + o * (I / 32) : nullptr};
  }
  INLINE void prefetch(const Row& r, int64_t b) const {
    vec::prefetch(r.qs, 16 * b), vec::prefetch(r.qh, 4 * b), vec::prefetch(r.d, b);
    if constexpr (kMin) vec::prefetch(r.m, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    uint32_t high;
    std::memcpy(&high, r.qh + 4 * b, 4);
    const float base = kMin ? 0 : -16;
    return {r.qs + 16 * b, high, levels<kMin>(r.d, r.m, b, base),
            levels<kMin>(r.d, r.m, b, base + 16)};
  }
  template <int G>
  INLINE F value(const Blk& k) const {
    const Int z = u8x16(k.qs);
    return lookup32(G ? z >> 4 : z, (k.high >> (16 * G)) & 0xFFFF, k.lo, k.hi);
  }
  // One-row products: block_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
  static constexpr Q8 kActs = kMin ? Q8::k1 : Q8::k0;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// The levels of 16 bytes of nibbles as floats, widened once for both halves: lo = the low
// nibbles, hi = the high ones, each plus 16 in the lanes of its fifth-bit mask (kFifth).
template <bool kFifth>
INLINE void nibble_levels(const uint8_t* p, Mask lo5, Mask hi5, F& lo, F& hi) {
  const Int z = u8x16(p);
  Int l = z & 0x0F, h = z >> 4;
  if constexpr (kFifth) {
    l = l | (expand(lo5) & 16);
    h = h | (expand(hi5) & 16);
  }
  lo = to_float(l), hi = to_float(h);
}

// One row o of a Q4_0 / Q4_1 / Q5_0 / Q5_1 weight times one activation row x [I], given x's
// sums per block (sums [I / 32]): sum_b d[b] (q_b . x_b) + sum_b c[b] sums[b], where c is the
// block's min (Q4_1, Q5_1) or -8 d (Q4_0; -16 d, Q5_0). As k_dot below: the levels exact
// floats, the 16 bytes widened once for both nibbles, the scale applied once per block.
template <class Fmt>
INLINE float block_dot(const Fmt& f, int64_t o, const float* x, const float* sums) {
  constexpr bool kFifth = !std::is_same_v<Fmt, Q4<false>> && !std::is_same_v<Fmt, Q4<true>>;
  constexpr bool kMin = std::is_same_v<Fmt, Q4<true>> || std::is_same_v<Fmt, Q5<true>>;
  constexpr float kOffset = kFifth ? -16.0f : -8.0f;
  const typename Fmt::Row r = f.row(o);
  F acc = zero();
  float offsets = 0.0f;
  for (int64_t b = 0; b < f.I / 32; ++b) {
    f.prefetch(r, b + Fmt::kAhead);
    uint32_t high = 0;  // bit j: value j's fifth bit
    if constexpr (kFifth) std::memcpy(&high, r.qh + 4 * b, 4);
    F lo, hi;  // values j (low nibbles) and 16 + j (high)
    nibble_levels<kFifth>(r.qs + 16 * b, high & 0xFFFF, high >> 16, lo, hi);
    F part = lo * load(x + 32 * b);
    part = fma(hi, load(x + 32 * b + 16), part);
    const float d = h2f(r.d[b]);
    acc = fma(set1(d), part, acc);
    offsets += (kMin ? h2f(r.m[b]) : kOffset * d) * sums[b];
  }
  return hsum(acc) + offsets;
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
  const F8 s = u8x8(sc) * h2f(d);
  const F8 m = u8x8(mn) * h2f(dmin);
  std::memcpy(scale, &s, 32), std::memcpy(low, &m, 32);
}

// Q4_K (256 values, 8 sub-blocks of 32): qs [O, I / 2] (per 64 values, byte l: value l low
// nibble, 32 + l high), sc and mn uint8 [O, I / 32] (6-bit, unpacked at load), d and dmin f16
// [O, I / 256]; w = (d * sc[j]) * q - (dmin * mn[j]) in sub-block j.
struct Q4_K {  // the format interface (boilerplate)
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 16;  // blocks to prefetch ahead: 2 KiB of the main stream
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
    vec::prefetch(r.qs, 128 * b), vec::prefetch(r.qs, 128 * b + 64), vec::prefetch(r.sc, 8 * b),
        vec::prefetch(r.mn, 8 * b), vec::prefetch(r.d, b), vec::prefetch(r.dmin, b);
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
  INLINE F value(const Blk& k) const {
    constexpr int j = G / 2, h = G % 2, c = j / 2, p = j % 2;
    const Int z = u8x16(k.qs + 32 * c + 16 * h);
    const F table = bcast(&k.scale[j]) * iota(0) - bcast(&k.low[j]);
    return lookup(p ? z >> 4 : z, table);
  }
  // One-row products: k_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
  static constexpr Q8 kActs = Q8::kK;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// Q5_K: Q4_K plus qh [O, I / 8] (32 bytes per block: bit j of byte l is value 32 j + l's
// fifth bit).
struct Q5_K {  // the format interface (boilerplate)
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 16;  // blocks to prefetch ahead: 2.5 KiB of the main streams
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
    vec::prefetch(r.qs, 128 * b), vec::prefetch(r.qs, 128 * b + 64), vec::prefetch(r.qh, 32 * b),
        vec::prefetch(r.sc, 8 * b), vec::prefetch(r.mn, 8 * b), vec::prefetch(r.d, b),
        vec::prefetch(r.dmin, b);
  }
  INLINE Blk block(const Row& r, int64_t b) const {
    Blk k;
    k.qs = r.qs + 128 * b;
    k.qh = r.qh + 32 * b;
    k_scales(k.scale, k.low, r.sc + 8 * b, r.mn + 8 * b, r.d[b], r.dmin[b]);
    return k;
  }
  template <int G>
  INLINE F value(const Blk& k) const {
    constexpr int j = G / 2, h = G % 2, c = j / 2, p = j % 2;
    const Int z = u8x16(k.qs + 32 * c + 16 * h);
    // fifth bits of values 32 j + 16 h + [0, 16): bit j of qh bytes 16 h + [0, 16)
    const Mask high = test_bytes(k.qh + 16 * h, uint8_t(1 << j));
    const F s = bcast(&k.scale[j]), l = bcast(&k.low[j]);
    return lookup32(p ? z >> 4 : z, high, s * iota(0) - l, s * iota(16) - l);
  }
  // One-row products: k_dot (below).
  static constexpr bool kSums = true;
  INLINE float dot(int64_t o, const float* x, const float* sums) const;
  static constexpr Q8 kActs = Q8::kK;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// One row o of a Q4_K or Q5_K weight times one activation row x [I], given x's sums over
// each sub-block (sums [I / 32]): sum_j scale[j] (q_j . x_j) - sum_j low[j] sums[j]. The
// levels q are exact floats, each 16 bytes of nibbles widened once for both their halves,
// and a sub-block's scale waits for its 32 products: no table lookup and no table to build
// per sub-block (a cache-resident q4_k matvec on AVX-512: 1.38 -> 1.02 ns per 16 values; 86M
// Q4_K decode 1.23x). Within float32 rounding of the dequantized weights' products (3e-8 of
// the sum of |terms| measured), not bit-equal to them.
template <class Fmt>
INLINE float k_dot(const Fmt& f, int64_t o, const float* x, const float* sums) {
  constexpr bool kFifth = std::is_same_v<Fmt, Q5_K>;
  const typename Fmt::Row r = f.row(o);
  F acc = zero();
  F8 mins = F8{};
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + Fmt::kAhead);
    alignas(32) float scale[8], low[8];
    k_scales(scale, low, r.sc + 8 * b, r.mn + 8 * b, r.d[b], r.dmin[b]);
    mins = mins + load8(low) * load8(sums + 8 * b);
    const float* xb = x + 256 * b;
    static_for<4>([&](auto c) {  // bytes [32 c, 32 c + 32): sub-blocks 2c (low), 2c + 1
      F part[2];
      static_for<2>([&](auto h) {  // bytes 16 h + [0, 16): values 16 h + [0, 16) of both
        Mask lo5 = 0, hi5 = 0;
        if constexpr (kFifth) {  // bit j of qh byte l: value 32 j + l's fifth bit
          lo5 = test_bytes(r.qh + 32 * b + 16 * h, uint8_t(1 << (2 * c)));
          hi5 = test_bytes(r.qh + 32 * b + 16 * h, uint8_t(2 << (2 * c)));
        }
        F lv, hv;
        nibble_levels<kFifth>(r.qs + 128 * b + 32 * c + 16 * h, lo5, hi5, lv, hv);
        const float* xs = xb + 64 * c + 16 * h;
        if constexpr (h == 0) {
          part[0] = lv * load(xs);
          part[1] = hv * load(xs + 32);
        } else {
          part[0] = fma(lv, load(xs), part[0]);
          part[1] = fma(hv, load(xs + 32), part[1]);
        }
      });
      acc = fma(set1(scale[2 * c]), part[0], acc);
      acc = fma(set1(scale[2 * c + 1]), part[1], acc);
    });
  }
  float m = 0.0f;
  for (int l = 0; l < 8; ++l) m += mins[l];
  return hsum(acc) - m;
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
struct Q6_K {  // the format interface (boilerplate)
  static constexpr int kBlock = 256;
  static constexpr bool kTail = false;
  static constexpr int kAhead = 32;  // blocks to prefetch ahead: 4 KiB of the main stream
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
    vec::prefetch(r.ql, 128 * b), vec::prefetch(r.ql, 128 * b + 64), vec::prefetch(r.qh, 64 * b),
        vec::prefetch(r.sc, 16 * b), vec::prefetch(r.d, b);
  }
  // The block's 6-bit values assembled 64 at a time with byte operations, then widened 16 at
  // a time: a third fewer vector operations than assembling each 16 in 32-bit lanes (a
  // cache-resident q6_k matvec ran 25% faster on AVX-512).
  INLINE Blk block(const Row& r, int64_t b) const {
    Blk k;
    const uint8_t *ql = r.ql + 128 * b, *qh = r.qh + 64 * b;
    for (int H = 0; H < 2; ++H) {  // values [128 H, 128 H + 128)
      const B64 l = *reinterpret_cast<const B64*>(ql + 64 * H);
      const B32 h = *reinterpret_cast<const B32*>(qh + 32 * H);
      // values 32 s + l: the low nibble of byte l (s < 2) or its high one (s >= 2), the top
      // bits at shift 2 s of qh byte l, moved to bits 4..5
      const B64 top_lo = concat(B32(h << 4), B32(h << 2)), top_hi = concat(h, B32(h >> 2));
      const B64 q_lo = (l & 0x0F) | (top_lo & 0x30), q_hi = (l >> 4) | (top_hi & 0x30);
      const B64 lo = q_lo - 32, hi = q_hi - 32;  // as int8: q - 32
      std::memcpy(k.q + 128 * H, &lo, 64), std::memcpy(k.q + 128 * H + 64, &hi, 64);
    }
    store(k.scale, set1(h2f(r.d[b])) * to_float(s8x16(r.sc + 16 * b)));
    return k;
  }
  static INLINE B64 concat(B32 a, B32 b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                   16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                                   31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45,
                                   46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60,
                                   61, 62, 63);
  }
  template <int G>
  INLINE F value(const Blk& k) const {
    return bcast(&k.scale[G]) * to_float(s8x16(k.q + 16 * G));
  }
  static constexpr Q8 kActs = Q8::kK;
  template <int MT>
  INLINE void idot(int64_t o, const Acts* a, float* out) const;
};

// ---- One weight row times MT activation rows quantized to 8 bits (Acts) ----
// out[m] = the row's product with a[m]: integer products of the weight's values and the
// activations' q (vec::dot), scaled per block as llama.cpp's vec_dot_<format>_q8 does (float32
// accumulation in 8 lanes; its order differs from llama.cpp's only in rounding). The weight's
// bytes are assembled once per 32 values for all MT rows.

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: per block of 32, (dw dx) (q . qx) [+ m s].
template <class Fmt, int MT>
INLINE void block_idot(const Fmt& f, int64_t o, const Acts* a, float* out) {
  constexpr bool kQ8 = std::is_same_v<Fmt, Q8_0>;
  constexpr bool kFifth = std::is_same_v<Fmt, Q5<false>> || std::is_same_v<Fmt, Q5<true>>;
  constexpr bool kMin = std::is_same_v<Fmt, Q4<true>> || std::is_same_v<Fmt, Q5<true>>;
  const typename Fmt::Row r = f.row(o);
  F8 acc[MT] = {};
  float mins[MT] = {};
  for (int64_t b = 0; b < f.I / 32; ++b) {
    f.prefetch(r, b + Fmt::kAhead);
    S8 w;
    if constexpr (kQ8) {
      w = load32(r.q + 32 * b);
    } else {
      B32 z = nibbles(r.qs + 16 * b);
      if constexpr (kFifth) {
        uint32_t high;
        std::memcpy(&high, r.qh + 4 * b, 4);
        z = z | bit_bytes(high);
      }
      w = S8(z);
      if constexpr (!kMin) w = w - int8_t(kFifth ? 16 : 8);
    }
    const float dw = h2f(r.d[b]);
    static_for<MT>([&](auto m) UNROLLED {
      const I8 p = dot(w, load32(a[m].q + 32 * b));
      acc[m] = fma(set8(dw * a[m].d[b]), to_float(p), acc[m]);
      if constexpr (kMin) mins[m] += h2f(r.m[b]) * a[m].s[b];
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]) + mins[m]; });
}
#if defined(JAXINFER_AVX512)
// ---- Q8_0's and the K-quants' idot in 512-bit registers (AVX-512) ----
// Decode's matvecs are these products at one to four activation rows. In 32-byte halves
// with the sign trick of vec::dot they were compute-bound (12-13 GB/s a thread where one
// thread reads 20 GB/s); here 64 values take one load, the nibble split, and two multiply-adds:
// maddubs (the weight's unsigned q, or Q6_K's q - 32 as q x - 32 x, times the activations'
// int8) and a pairwise int16 product with the sub-block scales spread over the lanes
// (vpdpwssd with VNNI), exact in int32 as vec::dot. Q8_0's block sums then take llama.cpp's
// float steps (half); the K-quants' sum in 16 float lanes, their min terms in 8 (k_idot's
// form). Summed in 8 lanes with a horizontal integer sum of the mins per block, Q4_K's product
// was compute-bound: 17.1 GB/s a thread from L2, 25.1 on two threads over a 592 MB matrix;
// now 23.7 and 30.0 (a plain 2-thread read: 31-37). Prefetch: 4 KiB ahead for Q8_0 and Q6_K,
// 2 KiB for Q4_K and Q5_K (with the faster body, 4 KiB was too far).

// 8 unaligned bytes into the low lanes (wider loads: vec::load_as).
INLINE __m128i load64(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }

// Half h of a 512-bit vector of int32 sums: one Q8_0 block's sums as block_idot's 8 lanes,
// which then take its float steps, llama.cpp's (8-lane fma per block, hsum_float_8): a
// 16-lane float sum moved a tiny-random hybrid Q8_0 fixture off llama.cpp's greedy ids at a
// near tie (the K-quant fixtures compare logits within float32 noise, which 16 lanes keep).
INLINE I8 half(__m512i v, int h) {
  return I8(h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
}

// x += p * s in int32 pairs: p the int16 pairs of a maddubs, s the lanes' scales.
INLINE __m512i dot_pairs(__m512i x, __m512i p, __m512i s) {
#if defined(JAXINFER_VNNI)
  return _mm512_dpwssd_epi32(x, p, s);
#else
  return _mm512_add_epi32(x, _mm512_madd_epi16(p, s));
#endif
}
// Q8_0: two blocks per 64-byte load, |w| times x with w's sign (w may hold -128, x never:
// the unsigned operand is |w|, as vec::dp4<kFull>), summed in int32 per 4 values (vpdpbusd
// with VNNI): lanes [0, 8) block b, [8, 16) block b + 1, each scaled by its dw dx. An odd
// last block takes block_idot's 32-byte step.
template <int MT>
INLINE void q8_idot512(const Q8_0& f, int64_t o, const Acts* a, float* out) {
  const Q8_0::Row r = f.row(o);
  F8 acc[MT] = {};
  const __m512i zero = _mm512_setzero_si512();
  const int64_t nb = f.I / 32;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    f.prefetch(r, b + Q8_0::kAhead);
    const __m512i w = _mm512_loadu_si512(r.q + 32 * b);
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const float d0 = h2f(r.d[b]), d1 = h2f(r.d[b + 1]);
    static_for<MT>([&](auto m) UNROLLED {
      const __m512i x = _mm512_loadu_si512(a[m].q + 32 * b);
      const __m512i sx = _mm512_mask_sub_epi8(x, neg, zero, x);  // x sign(w)
#if defined(JAXINFER_VNNI)
      const __m512i p = _mm512_dpbusd_epi32(zero, aw, sx);
#else
      const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), _mm512_set1_epi16(1));
#endif
      acc[m] = fma(set8(d0 * a[m].d[b]), to_float(half(p, 0)), acc[m]);
      acc[m] = fma(set8(d1 * a[m].d[b + 1]), to_float(half(p, 1)), acc[m]);
    });
  }
  if (b < nb) {
    const S8 w = load32(r.q + 32 * b);
    const float dw = h2f(r.d[b]);
    static_for<MT>([&](auto m) UNROLLED {
      acc[m] = fma(set8(dw * a[m].d[b]), to_float(dot(w, load32(a[m].q + 32 * b))), acc[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]); });
}

// The scale index of each int16 lane (two values) of a 64-value group, as vpermw takes it:
// k4[k]: sub-blocks 2k, 2k + 1 (32 values each) of a Q4_K / Q5_K block; k6[k]: Q6_K's groups
// 4k .. 4k + 3 (16 values each).
struct ScaleLanes {
  alignas(64) int16_t k4[4][32], k6[4][32];
  constexpr ScaleLanes() : k4(), k6() {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l)
        k4[k][l] = int16_t(2 * k + l / 16), k6[k][l] = int16_t(4 * k + l / 8);
  }
};
inline constexpr ScaleLanes kScaleLanes{};

// Q4_K, Q5_K: a block's 128 bytes of nibbles as two loads of 64 (chunks 2h, 2h + 1); the low
// nibbles are values 128 h + [0, 32) and + [64, 96), the high ones + [32, 64) and + [96, 128),
// put in order by two 128-bit lane shuffles. Q5_K's fifth bit of value 32 j + l is bit j of
// qh byte l, moved to bit 4 of its byte by a 16-bit shift (bits of the next byte land
// outside 0x10).
template <class Fmt, int MT>
INLINE void k_idot512(const Fmt& f, int64_t o, const Acts* a, float* out) {
  constexpr bool kFifth = std::is_same_v<Fmt, Q5_K>;
  const typename Fmt::Row r = f.row(o);
  F acc[MT];
  F8 mins[MT] = {};
  static_for<MT>([&](auto m) UNROLLED { acc[m] = zero(); });
  const __m512i nib = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  __m512i lanes[4];
  static_for<4>([&](auto k) UNROLLED { lanes[k] = _mm512_load_si512(kScaleLanes.k4[k]); });
  // fifth bits: bit j to bit 4, for j = 4 h + [0, 4) in the four 32-byte halves of h's groups
  const __m512i up0 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(3), 1);
  const __m512i up1 = _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_set1_epi16(1), 1);
  const __m512i down0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
  const __m512i down1 = _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_set1_epi16(3), 1);
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + Fmt::kAhead);
    const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(load64(r.sc + 8 * b)));
    __m512i high;
    if constexpr (kFifth)
      high = _mm512_broadcast_i64x4(load_as<__m256i>(r.qh + 32 * b));
    __m512i sum[MT][2];  // per h: two chains
    static_for<2>([&](auto h) UNROLLED {
      const __m512i z = _mm512_loadu_si512(r.qs + 128 * b + 64 * h);
      const __m512i lo = _mm512_and_si512(z, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
      __m512i w0 = _mm512_shuffle_i64x2(lo, hi, 0x44), w1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);
      if constexpr (kFifth) {
        const __m512i t0 = h ? _mm512_srlv_epi16(high, down0) : _mm512_sllv_epi16(high, up0);
        const __m512i t1 = h ? _mm512_srlv_epi16(high, down1) : _mm512_sllv_epi16(high, up1);
        w0 = _mm512_or_si512(w0, _mm512_and_si512(t0, bit4));
        w1 = _mm512_or_si512(w1, _mm512_and_si512(t1, bit4));
      }
      const __m512i s0 = _mm512_permutexvar_epi16(lanes[2 * h], sc);
      const __m512i s1 = _mm512_permutexvar_epi16(lanes[2 * h + 1], sc);
      static_for<MT>([&](auto m) UNROLLED {
        const int8_t* x = a[m].q + 256 * b + 128 * h;
        const __m512i p0 = _mm512_maddubs_epi16(w0, _mm512_loadu_si512(x));
        const __m512i p1 = _mm512_maddubs_epi16(w1, _mm512_loadu_si512(x + 64));
        sum[m][h] = dot_pairs(dot_pairs(_mm512_setzero_si512(), p0, s0), p1, s1);
      });
    });
    const float dw = h2f(r.d[b]);
    const F8 low = u8x8(r.mn + 8 * b) * set8(h2f(r.dmin[b]));  // dmin mn[j]
    static_for<MT>([&](auto m) UNROLLED {
      const Int s = Int(_mm512_add_epi32(sum[m][0], sum[m][1]));
      acc[m] = fma(set1(dw * a[m].d[b]), to_float(s), acc[m]);
      mins[m] = fma(low, load8(a[m].s + 8 * b), mins[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]) - hsum(mins[m]); });
}

// Q6_K: per 128 values, 64 bytes of low nibbles (values [0, 64) low, [64, 128) high) and 32
// of top bits (bits 2s, 2s + 1 of byte l: value 32 s + l), broadcast to both halves and
// shifted to bits 4, 5 per half.
template <int MT>
INLINE void q6_idot512(const Q6_K& f, int64_t o, const Acts* a, float* out) {
  const Q6_K::Row r = f.row(o);
  F acc[MT];
  static_for<MT>([&](auto m) UNROLLED { acc[m] = zero(); });
  const __m512i nib = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  const __m512i k32 = _mm512_set1_epi8(32);
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  __m512i lanes[4];
  static_for<4>([&](auto k) UNROLLED { lanes[k] = _mm512_load_si512(kScaleLanes.k6[k]); });
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + Q6_K::kAhead);
    const __m256i sc16 = _mm256_cvtepi8_epi16(load_as<__m128i>(r.sc + 16 * b));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    __m512i sum[MT][2];
    static_for<2>([&](auto H) UNROLLED {
      const __m512i l = _mm512_loadu_si512(r.ql + 128 * b + 64 * H);
      const __m512i h = _mm512_broadcast_i64x4(load_as<__m256i>(r.qh + 64 * b + 32 * H));
      const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l, nib),
                                         _mm512_and_si512(_mm512_sllv_epi16(h, up), top));
      const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), nib),
                                         _mm512_and_si512(_mm512_srlv_epi16(h, down), top));
      const __m512i s0 = _mm512_permutexvar_epi16(lanes[2 * H], sc);
      const __m512i s1 = _mm512_permutexvar_epi16(lanes[2 * H + 1], sc);
      static_for<MT>([&](auto m) UNROLLED {
        const int8_t* x = a[m].q + 256 * b + 128 * H;
        const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 64);
        // (q - 32) x in int16 pairs: |q x| <= 2 * 63 * 127 and 32 |x| <= 2 * 32 * 127 fit
        const __m512i p0 =
            _mm512_sub_epi16(_mm512_maddubs_epi16(q0, x0), _mm512_maddubs_epi16(k32, x0));
        const __m512i p1 =
            _mm512_sub_epi16(_mm512_maddubs_epi16(q1, x1), _mm512_maddubs_epi16(k32, x1));
        sum[m][H] = dot_pairs(_mm512_madd_epi16(p0, s0), p1, s1);
      });
    });
    const float dw = h2f(r.d[b]);
    static_for<MT>([&](auto m) UNROLLED {
      const Int s = Int(_mm512_add_epi32(sum[m][0], sum[m][1]));
      acc[m] = fma(set1(dw * a[m].d[b]), to_float(s), acc[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]); });
}
#endif

template <int MT>
INLINE void Q8_0::idot(int64_t o, const Acts* a, float* out) const {
#if defined(JAXINFER_AVX512)
  q8_idot512<MT>(*this, o, a, out);
#else
  block_idot<Q8_0, MT>(*this, o, a, out);
#endif
}
template <bool kMin>
template <int MT>
INLINE void Q4<kMin>::idot(int64_t o, const Acts* a, float* out) const {
  block_idot<Q4<kMin>, MT>(*this, o, a, out);
}
template <bool kMin>
template <int MT>
INLINE void Q5<kMin>::idot(int64_t o, const Acts* a, float* out) const {
  block_idot<Q5<kMin>, MT>(*this, o, a, out);
}

// Q4_K, Q5_K: per block of 256, dw dx sum_j sc[j] (q_j . qx_j) - sum_j (dminw mn[j]) s[j]
// (the sub-block scales applied in the integer products, as llama.cpp does; the min terms in
// 8 float lanes, as its AVX2 body's).
template <class Fmt, int MT>
INLINE void k_idot(const Fmt& f, int64_t o, const Acts* a, float* out) {
  constexpr bool kFifth = std::is_same_v<Fmt, Q5_K>;
  const typename Fmt::Row r = f.row(o);
  F8 acc[MT] = {}, mins[MT] = {};
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + Fmt::kAhead);
    I8 sum[MT] = {};
    B32 high;
    if constexpr (kFifth) high = load32(r.qh + 32 * b);  // bit j of byte l: value 32 j + l
    const uint8_t* sc = r.sc + 8 * b;
    static_for<4>([&](auto c) UNROLLED {  // values [64 c, 64 c + 64): sub-blocks 2c, 2c + 1
      const B32 z = load32(r.qs + 128 * b + 32 * c);
      B32 lo = z & 15, hi = z >> 4;
      if constexpr (kFifth) {
#if defined(JAXINFER_AVX2)
        // bit j of each byte to bit 4, masked first so that a 16-bit shift moves it alone
        // (the generic form's 8-bit shifts are 16-bit ones and masks on x86): Q5_K's decode
        // 16.1 -> 21.8 GB/s a thread from L2
        auto fifth = [&](int j) {
          const __m256i bit = _mm256_and_si256(__m256i(high), _mm256_set1_epi8(char(1 << j)));
          return B32(j < 4 ? _mm256_slli_epi16(bit, 4 - j) : _mm256_srli_epi16(bit, j - 4));
        };
        lo = lo | fifth(2 * c), hi = hi | fifth(2 * c + 1);
#else
        lo = lo | (((high >> (2 * c)) & 1) << 4);
        hi = hi | (((high >> (2 * c + 1)) & 1) << 4);
#endif
      }
      const int16_t s0 = sc[2 * c], s1 = sc[2 * c + 1];
      static_for<MT>([&](auto m) UNROLLED {
        const int8_t* x = a[m].q + 256 * b + 64 * c;
        sum[m] = sum[m] + udot(lo, load32(x), s0, s0) + udot(hi, load32(x + 32), s1, s1);
      });
    });
    const float dw = h2f(r.d[b]);
    const F8 low = u8x8(r.mn + 8 * b) * set8(h2f(r.dmin[b]));  // dmin mn[j]
    static_for<MT>([&](auto m) UNROLLED {
      acc[m] = fma(set8(dw * a[m].d[b]), to_float(sum[m]), acc[m]);
      mins[m] = fma(low, load8(a[m].s + 8 * b), mins[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]) - hsum(mins[m]); });
}
template <int MT>
INLINE void Q4_K::idot(int64_t o, const Acts* a, float* out) const {
#if defined(JAXINFER_AVX512)
  k_idot512<Q4_K, MT>(*this, o, a, out);
#else
  k_idot<Q4_K, MT>(*this, o, a, out);
#endif
}
template <int MT>
INLINE void Q5_K::idot(int64_t o, const Acts* a, float* out) const {
#if defined(JAXINFER_AVX512)
  k_idot512<Q5_K, MT>(*this, o, a, out);
#else
  k_idot<Q5_K, MT>(*this, o, a, out);
#endif
}

#if defined(JAXINFER_AVX2)
// Q6_K in 256-bit registers: the 6-bit q assembled unsigned (0..63) and multiplied as
// maddubs's unsigned operand, q x - 32 x in int16 pairs (llama.cpp's AVX2 form: no sign
// operations), the two group scales of each 32 values spread by one byte shuffle.
template <int MT>
INLINE void q6_idot256(const Q6_K& f, int64_t o, const Acts* a, float* out) {
  const Q6_K::Row r = f.row(o);
  F8 acc[MT] = {};
  const __m256i nib = _mm256_set1_epi8(15), k32 = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < f.I / 256; ++b) {
    f.prefetch(r, b + Q6_K::kAhead);
    const __m128i sc = load_as<__m128i>(r.sc + 16 * b);
    __m256i sum[MT];
    static_for<MT>([&](auto m) UNROLLED { sum[m] = _mm256_setzero_si256(); });
    static_for<2>([&](auto H) UNROLLED {  // values [128 H, 128 H + 128)
      const __m256i l0 = load_as<__m256i>(r.ql + 128 * b + 64 * H);
      const __m256i l1 = load_as<__m256i>(r.ql + 128 * b + 64 * H + 32);
      const __m256i h = load_as<__m256i>(r.qh + 64 * b + 32 * H);
      static_for<4>([&](auto s) UNROLLED {  // values 32 s + [0, 32): the top bits at 2 s
        const __m256i low = s % 2 ? l1 : l0;
        const __m256i lo4 = _mm256_and_si256(s < 2 ? low : _mm256_srli_epi16(low, 4), nib);
        const __m256i top = _mm256_and_si256(h, _mm256_set1_epi8(char(3 << (2 * s))));
        const __m256i hi2 = s == 0   ? _mm256_slli_epi16(top, 4)
                            : s == 1 ? _mm256_slli_epi16(top, 2)
                            : s == 2 ? top
                                     : _mm256_srli_epi16(top, 2);
        const __m256i q = _mm256_or_si256(lo4, hi2);
        constexpr int g = 8 * H + 2 * s;  // the block's groups g, g + 1
        const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (g + 1),
                                            0x0101010101010101LL * g);
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick));
        static_for<MT>([&](auto m) UNROLLED {
          const __m256i x = load_as<__m256i>(a[m].q + 256 * b + 128 * H + 32 * s);
          // |q x| pairs <= 2 * 63 * 127 and 32 |x| pairs <= 2 * 32 * 127: exact in int16
          const __m256i p =
              _mm256_sub_epi16(_mm256_maddubs_epi16(q, x), _mm256_maddubs_epi16(k32, x));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scale));
        });
      });
    });
    const float dw = h2f(r.d[b]);
    static_for<MT>([&](auto m) UNROLLED {
      acc[m] = fma(set8(dw * a[m].d[b]), to_float(I8(sum[m])), acc[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]); });
}
#endif

// Q6_K: per block of 256, dw dx sum_g sc[g] ((q_g - 32) . qx_g), 16 groups of 16.
template <int MT>
INLINE void Q6_K::idot(int64_t o, const Acts* a, float* out) const {
#if defined(JAXINFER_AVX512)
  q6_idot512<MT>(*this, o, a, out);
#elif defined(JAXINFER_AVX2)
  q6_idot256<MT>(*this, o, a, out);
#else
  const Row r = row(o);
  F8 acc[MT] = {};
  for (int64_t b = 0; b < I / 256; ++b) {
    prefetch(r, b + kAhead);
    I8 sum[MT] = {};
    static_for<2>([&](auto H) UNROLLED {  // values [128 H, 128 H + 128)
      const B32 l0 = load32(r.ql + 128 * b + 64 * H), l1 = load32(r.ql + 128 * b + 64 * H + 32);
      const B32 h = load32(r.qh + 64 * b + 32 * H);
      static_for<4>([&](auto s) UNROLLED {  // values 32 s + [0, 32)
        const B32 low = s % 2 ? l1 : l0;
        const B32 q = (s < 2 ? low & 15 : low >> 4) | (((h >> (2 * s)) & 3) << 4);
        const S8 w = S8(q) - int8_t(32);
        const int g = 16 * b + 8 * H + 2 * s;
        static_for<MT>([&](auto m) UNROLLED {
          const S8 x = load32(a[m].q + 256 * b + 128 * H + 32 * s);
          sum[m] = sum[m] + dot(w, x, r.sc[g], r.sc[g + 1]);
        });
      });
    });
    const float dw = h2f(r.d[b]);
    static_for<MT>([&](auto m) UNROLLED {
      acc[m] = fma(set8(dw * a[m].d[b]), to_float(sum[m]), acc[m]);
    });
  }
  static_for<MT>([&](auto m) UNROLLED { out[m] = hsum(acc[m]); });
#endif
}

}  // namespace jaxinfer::formats
