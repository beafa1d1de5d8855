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
// The K-quants on AVX-512 (kIntScales) keep a block's sums in int32, as llama.cpp's vec_dot
// does: each sub-block's integer sum times the weight's integer scale sc[j], the min terms as
// mn[j] times the activations' integer sums per sub-block (vpdpwssd, two sub-blocks a step),
// then one float step per 256 values: d_w d_x (sum) - dmin_w d_x (mins). Per sub-block that
// is one vpmulld and one add where the float form took a conversion, a multiply, an fma and
// the min term's fma: at Llama-3-8B's shapes on Zen 4 (the tile being 85% of a 512-token
// prompt), see benchmarks/results/realshape.md. AVX2 keeps the same int32 block sums with the
// scale inside the products: spans of products summed in int16 (vpmaddubsw, vpaddw; Q4_K /
// Q5_K's unsigned values are its unsigned operand as they are), widened times sc[j]
// (vpmaddwd), 4 rows a tile: 1.5-1.9x the float form's rate (vec.h's dp4w).
//
// Work split: output rows over the threads (qmatmul.h's run); each thread unpacks kChunk
// rows (a few hundred KiB, kept in L2), then for each pair of panels multiplies them kTile
// rows at a time, 16 activation rows per register (a weight row's broadcast 4 bytes serve two
// panels: the broadcasts, not the products, had been half the tile's instructions).
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
  static constexpr bool kLow = false, kFull = true, kInt = false;
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
  static constexpr bool kLow = kMin, kFull = false, kInt = false;
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
  static constexpr bool kLow = kMin, kFull = false, kInt = false;
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
  static constexpr bool kLow = true, kFull = false, kInt = true;
  static constexpr bool kUnsigned = true;       // values in [0, 15] / [0, 31]
  static constexpr int kSpan = kFifth ? 4 : 8;  // vec.h's dp4w: groups per int16 sum
  // Integer scales sc[j], the block's d and -dmin, the mins mn[j] as int16 pairs.
  static INLINE void ints(const Fmt&, const typename Fmt::Row& r, int64_t b, int32_t* isc,
                          float* dw, float* dm, int32_t* mnp) {
    for (int j = 0; j < 8; ++j) isc[j] = r.sc[8 * b + j];
    const uint8_t* mn = r.mn + 8 * b;
    for (int j = 0; j < 4; ++j) mnp[j] = int32_t(mn[2 * j]) | int32_t(mn[2 * j + 1]) << 16;
    dw[0] = h2f(r.d[b]), dm[0] = -h2f(r.dmin[b]);
  }
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
  static constexpr bool kLow = false, kFull = false, kInt = true, kUnsigned = false;
  static constexpr int kSpan = 4;  // vec.h's dp4w: groups per int16 sum (|q - 32| <= 32)
  static INLINE void ints(const Q6_K&, const Q6_K::Row& r, int64_t b, int32_t* isc, float* dw,
                          float*, int32_t*) {
    for (int j = 0; j < 16; ++j) isc[j] = r.sc[16 * b + j];
    dw[0] = h2f(r.d[b]);
  }
  static INLINE void run(const Q6_K& f, const Q6_K::Row& r, int64_t b, int8_t* q, float* scale,
                         float*) {
    const Q6_K::Blk k = f.block(r, b);
    std::memcpy(q, k.q, 256), std::memcpy(scale, k.scale, 64);
  }
};

// Integer scales (the K-quants on AVX-512 and AVX2; see the top): the unpacked rows carry
// sc[j], and mn[j] as int16 pairs (mn[j], mn[j + 1]); the panels the activations' sums per
// sub-block as int16 pairs. AVX2 sums products in int16 and multiplies by sc[j] as it widens
// them (vec.h's dp4w, widen); NEON and the scalar build keep the float form.
template <class U>
constexpr bool kIntScales = U::kInt && (kRegisters >= 32 || kWordSums);

// Activation rows in panels of 16 (dp4's layout): x [P][I / 4][64 bytes], and per row and
// sub-block of kSub values its scale d and min term low [P][I / kSub][16]; with integer
// scales and a min term, the sums of q per pair of sub-blocks as int16 pairs bs [P][J / 2][16].
struct Panels {
  const uint8_t* x;
  const float* d;
  const float* low;  // formats with a min term only
  const int32_t* bs;
  int64_t count;     // P
};

// The panels' storage for M rows, in the calling thread's buffers (valid until its next call).
struct PanelBuffers {
  uint8_t* x;
  float *d, *low;
  int32_t* bs;
};
inline PanelBuffers panel_buffers(int64_t M, int64_t I, int64_t sub) {
  thread_local std::unique_ptr<uint8_t[]> x;
  thread_local std::unique_ptr<float[]> d;
  thread_local int64_t xcap = 0, dcap = 0;
  const int64_t P = (M + 15) / 16, nx = P * I * 16 + 64, nd = 3 * P * (I / sub) * 16 + 16;
  if (xcap < nx) x.reset(new uint8_t[xcap = nx]);
  if (dcap < nd) d.reset(new float[dcap = nd]);
  // 64-byte aligned: a panel group is one cache line
  uint8_t* xa = x.get() + (64 - reinterpret_cast<uintptr_t>(x.get()) % 64) % 64;
  float* da = d.get() + (16 - reinterpret_cast<uintptr_t>(d.get()) / 4 % 16) % 16;
  const int64_t n = P * (I / sub) * 16;
  return {xa, da, da + n, reinterpret_cast<int32_t*>(da + 2 * n)};
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
  int32_t* bs = out.bs + p * (J / 2) * 16 + l;
  constexpr bool kPairs = kIntScales<U> && U::kLow;
  if (!r) {
    const uint32_t zero = kBiasedX ? 0x80808080u : 0u;
    for (int64_t g = 0; g < I / 4; ++g) std::memcpy(x + 64 * g, &zero, 4);
    for (int64_t j = 0; j < J; ++j) d[16 * j] = 0.0f, low[16 * j] = 0.0f;
    if constexpr (kPairs)
      for (int64_t j = 0; j < J / 2; ++j) bs[16 * j] = 0;
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
  if constexpr (kPairs)
    for (int64_t j = 0; j < J / 2; ++j) {
      int32_t sum[2] = {0, 0};
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < S; ++k) sum[h] += r->q[(2 * j + h) * S + k];
      bs[16 * j] = int32_t(uint32_t(uint16_t(sum[0])) | uint32_t(uint16_t(sum[1])) << 16);
    }
}

// A register tile: kTile<Fmt> weight rows against kPanels<Fmt> panels of 16 activation rows.
// AVX-512 with VNNI and integer scales: 4 rows x 2 panels (each weight row's broadcast dword
// serves two products; 8 integer sums, 8 block sums and 8 float sums in 32 zmm); other
// AVX-512 tiles 8 rows x 1 panel (without VNNI the products' temporaries need the registers;
// the float-scaled formats keep 8 rows: Q8_0 ran 2% slower at 4 x 2); AVX2's integer-scale
// K-quants 4 x 1 (int16 sums, 8 ymm for 4 rows: at 2 x 1 each panel group served too few
// products); other 16-register sets 2 x 1.
template <class Fmt>
constexpr int kPanels = kIntScales<Unpack<Fmt>> && kBiasedX ? 2 : 1;
template <class Fmt>
constexpr int kTile = kRegisters >= 32 ? 8 / kPanels<Fmt> : (kIntScales<Unpack<Fmt>> ? 4 : 2);

// A thread's unpacked rows: values [R / T][I / 4][T][4], T = kTile<Fmt> (a tile's rows
// interleaved per 4 values, so that a tile reads its weights from one pointer at fixed
// offsets: with a pointer per row, gcc spent more instructions on addresses than on products;
// pp512 1.06x), and per row and sub-block scale, low and (biased panels) -128 times the
// values' sum, which starts each integer sum; with integer scales, per row the integer scales
// and min pairs per sub-block, and per block d, -dmin and the start (-128 sum_j sc[j] sum(q_j)).
struct Unpacked {
  int8_t* q;
  float *scale, *low;
  int32_t* start;     // [R][J], integer scales: [R][B]
  int32_t *isc, *mn;  // integer scales: [R][J], min pairs [R][J / 2]
  float *dw, *dm;     // integer scales: d, -dmin [R][B]
};

template <class Fmt>
Unpacked unpack_rows(const Fmt& f, int64_t o, int64_t R, int64_t I) {
  using U = Unpack<Fmt>;
  constexpr int S = U::kSub, JB = Fmt::kBlock / S;
  const int64_t J = I / S, B = I / Fmt::kBlock;
  thread_local std::unique_ptr<int8_t[]> q, line;
  thread_local std::unique_ptr<float[]> tables;
  thread_local std::unique_ptr<int32_t[]> ints;
  thread_local int64_t qcap = 0, tcap = 0, lcap = 0;
  constexpr int T = kTile<Fmt>;
  const int64_t padded = (R + T - 1) / T * T;
  if (qcap < padded * I) q.reset(new int8_t[qcap = padded * I]);
  if (lcap < I) line.reset(new int8_t[lcap = I]);
  if (tcap < R * J)
    tables.reset(new float[4 * R * J]), ints.reset(new int32_t[3 * R * J]), tcap = R * J;
  float* t = tables.get();
  int32_t* n = ints.get();
  Unpacked u{q.get(), t, t + R * J, n, n + R * J, n + 2 * R * J, t + 2 * R * J, t + 3 * R * J};
  for (int64_t r = 0; r < R; ++r) {
    const typename Fmt::Row row = f.row(o + r);
    int8_t* qr = line.get();
    for (int64_t b = 0; b < B; ++b) {
      f.prefetch(row, b + Fmt::kAhead);
      const int64_t j0 = b * JB;
      U::run(f, row, b, qr + b * Fmt::kBlock, u.scale + r * J + j0, u.low + r * J + j0);
      if constexpr (kIntScales<U>)
        U::ints(f, row, b, u.isc + r * J + j0, u.dw + r * B + b, u.dm + r * B + b,
                u.mn + r * (J / 2) + j0 / 2);
    }
    if constexpr (kBiasedX)
      for (int64_t b = 0; b < B; ++b) {
        int32_t total = 0;
        for (int64_t j = b * JB; j < (b + 1) * JB; ++j) {
          int32_t sum = 0;
          for (int k = 0; k < S; ++k) sum += qr[j * S + k];
          if constexpr (kIntScales<U>)
            total += sum * u.isc[r * J + j];
          else
            u.start[r * J + j] = -128 * sum;
        }
        if constexpr (kIntScales<U>) u.start[r * B + b] = -128 * total;
      }
    int8_t* at = u.q + (r / T) * T * I + (r % T) * 4;  // its lanes in its tile
    for (int64_t g = 0; g < I / 4; ++g) std::memcpy(at + g * 4 * T, qr + 4 * g, 4);
  }
  return u;
}

// fn(c, r) for every panel c < NP and row r < NO of a tile (integral constants).
template <int NP, int NO, class Fn>
INLINE void grid(Fn&& fn) {
  static_for<NP>([&](auto c) UNROLLED { static_for<NO>([&](auto r) UNROLLED { fn(c, r); }); });
}

// Output rows o + [0, NO) for the 16 NP activation rows of panels p.. (`valid`: real rows).
template <class Fmt, int NO, int NP>
__attribute__((noinline)) void tile(const Unpacked& u, int64_t r0, const Panels& a, int64_t p,
                                    int64_t I, int64_t valid, int64_t O, int64_t o, float* y) {
  using U = Unpack<Fmt>;
  constexpr int S = U::kSub, JB = Fmt::kBlock / S;
  const int64_t J = I / S, B = I / Fmt::kBlock;
  const uint8_t* xp = a.x + p * I * 16;
  const float* dp = a.d + p * J * 16;
  const float* lp = U::kLow ? a.low + p * J * 16 : nullptr;
  const int32_t* bp = a.bs + p * (J / 2) * 16;
  constexpr int T = kTile<Fmt>;
  const int8_t* wq = u.q + r0 * I;  // r0: a tile's first row
  F acc[NP][NO];
  grid<NP, NO>([&](auto c, auto r) UNROLLED { acc[c][r] = zero(); });
  // groups [g0, g0 + N) of sub-block j: step(c, r, x, w) for each panel group x and weight
  // dword w
  auto groups = [&](int64_t j, auto g0, auto n, auto&& step) UNROLLED {
    static_for<decltype(n)::value>([&](auto k) UNROLLED {
      constexpr int g = decltype(g0)::value + k;
      X8 xv[NP];
      static_for<NP>([&](auto c) UNROLLED { xv[c] = x8(xp + (c * I + (j * S + 4 * g)) * 16); });
      static_for<NO>([&](auto r) UNROLLED {
        int32_t w;
        std::memcpy(&w, wq + (j * S + 4 * g) * T + 4 * r, 4);
        static_for<NP>([&](auto c) UNROLLED { step(c, r, xv[c], w); });
      });
    });
  };
  // sub-block j's products added to sum [panel][row]
  auto sums = [&](int64_t j, Int (&sum)[NP][NO]) UNROLLED {
    groups(j, std::integral_constant<int, 0>{}, std::integral_constant<int, S / 4>{},
           [&](auto c, auto r, const X8& x, int32_t w) UNROLLED {
             sum[c][r] = dp4<U::kFull>(sum[c][r], x, w);
           });
  };
  if constexpr (kIntScales<U>) {
    for (int64_t b = 0; b < B; ++b) {
      Int tot[NP][NO];
      static_for<NO>([&](auto r) UNROLLED {
        const Int s0 = set1i(kBiasedX ? u.start[(r0 + r) * B + b] : 0);
        static_for<NP>([&](auto c) UNROLLED { tot[c][r] = s0; });
      });
      for (int64_t j = b * JB; j < (b + 1) * JB; ++j) {
        if constexpr (kWordSums) {  // int16 sums over spans, widened times the scale
          static_for<S / 4 / U::kSpan>([&](auto h) UNROLLED {
            Int pairs[NP][NO];
            grid<NP, NO>([&](auto c, auto r) UNROLLED { pairs[c][r] = set1i(0); });
            groups(j, std::integral_constant<int, h * U::kSpan>{},
                   std::integral_constant<int, U::kSpan>{},
                   [&](auto c, auto r, const X8& x, int32_t w) UNROLLED {
                     pairs[c][r] = dp4w<U::kUnsigned>(pairs[c][r], x, w);
                   });
            grid<NP, NO>([&](auto c, auto r) UNROLLED {
              tot[c][r] = widen(tot[c][r], pairs[c][r], u.isc[(r0 + r) * J + j]);
            });
          });
          continue;
        }
        Int sum[NP][NO];
        grid<NP, NO>([&](auto c, auto r) UNROLLED { sum[c][r] = set1i(0); });
        sums(j, sum);
        static_for<NO>([&](auto r) UNROLLED {
          const int32_t k = u.isc[(r0 + r) * J + j];
          static_for<NP>([&](auto c) UNROLLED { tot[c][r] = tot[c][r] + sum[c][r] * k; });
        });
      }
      if constexpr (U::kLow) {  // -dmin times the min pairs times the activations' sums
        Int m[NP][NO];
        grid<NP, NO>([&](auto c, auto r) UNROLLED { m[c][r] = set1i(0); });
        static_for<JB / 2>([&](auto h) UNROLLED {
          Int bv[NP];
          static_for<NP>([&](auto c) UNROLLED {
            bv[c] = load_as<Int>(bp + (c * (J / 2) + b * (JB / 2) + h) * 16);
          });
          static_for<NO>([&](auto r) UNROLLED {
            const int32_t k = u.mn[(r0 + r) * (J / 2) + b * (JB / 2) + h];
            static_for<NP>([&](auto c) UNROLLED { m[c][r] = dp2(m[c][r], bv[c], k); });
          });
        });
        static_for<NP>([&](auto c) UNROLLED {
          const F dv = load(dp + c * J * 16 + 16 * b * JB);
          static_for<NO>([&](auto r) UNROLLED {
            acc[c][r] = fma(to_float(m[c][r]), dv * bcast(u.dm + (r0 + r) * B + b), acc[c][r]);
          });
        });
      }
      static_for<NP>([&](auto c) UNROLLED {
        const F dv = load(dp + c * J * 16 + 16 * b * JB);
        static_for<NO>([&](auto r) UNROLLED {
          acc[c][r] = fma(to_float(tot[c][r]), dv * bcast(u.dw + (r0 + r) * B + b), acc[c][r]);
        });
      });
    }
  } else {
    for (int64_t j = 0; j < J; ++j) {
      Int sum[NP][NO];
      static_for<NO>([&](auto r) UNROLLED {
        const Int s0 = set1i(kBiasedX ? u.start[(r0 + r) * J + j] : 0);
        static_for<NP>([&](auto c) UNROLLED { sum[c][r] = s0; });
      });
      sums(j, sum);
      static_for<NP>([&](auto c) UNROLLED {
        const F dv = load(dp + c * J * 16 + 16 * j);
        static_for<NO>([&](auto r) UNROLLED {
          acc[c][r] = fma(to_float(sum[c][r]), dv * u.scale[(r0 + r) * J + j], acc[c][r]);
        });
        if constexpr (U::kLow) {
          const F lv = load(lp + c * J * 16 + 16 * j);
          static_for<NO>([&](auto r) UNROLLED {
            acc[c][r] = fma(lv, bcast(u.low + (r0 + r) * J + j), acc[c][r]);
          });
        }
      });
    }
  }
  static_for<NP>([&](auto c) UNROLLED {
    const int64_t n = std::min<int64_t>(16, valid - 16 * c);
    static_for<NO>([&](auto r) UNROLLED {
      alignas(64) float out[16];
      store(out, acc[c][r]);
      for (int64_t l = 0; l < n; ++l) y[(16 * (p + c) + l) * O + o + r] = out[l];
    });
  });
}

// Rows the thread unpacks at once: about 256 KiB of values, whole tiles.
template <class Fmt>
int64_t chunk_rows(int64_t I) {
  constexpr int T = kTile<Fmt>;
  return std::max<int64_t>(T, std::min<int64_t>(64, (int64_t{256} << 10) / I) / T * T);
}

// Output rows [lo, hi) of y [M, O] for all M activation rows in `a`.
template <class Fmt>
void rows(const Fmt& f, const Panels& a, int64_t M, int64_t I, int64_t O, int64_t lo, int64_t hi,
          float* y) {
  constexpr int T = kTile<Fmt>, NP = kPanels<Fmt>;
  const int64_t R = chunk_rows<Fmt>(I);
  for (int64_t c = lo; c < hi; c += R) {
    const int64_t n = std::min(R, hi - c);
    const Unpacked u = unpack_rows(f, c, n, I);
    for (int64_t p = 0; p < a.count; p += NP) {
      const int64_t valid = std::min<int64_t>(16 * NP, M - 16 * p);
      for (int64_t r0 = 0; r0 < n; r0 += T)
        dispatch<T>(std::min<int64_t>(T, n - r0), [&](auto no) {
          if (p + NP <= a.count)
            tile<Fmt, decltype(no)::value, NP>(u, r0, a, p, I, valid, O, c + r0, y);
          else  // the last panel of an odd count
            tile<Fmt, decltype(no)::value, 1>(u, r0, a, p, I, valid, O, c + r0, y);
        });
    }
  }
}

}  // namespace jaxinfer::gemm
