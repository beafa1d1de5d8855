// XLA FFI CPU kernels for quantized matmuls: y[m, o] = sum_i x[m, i] * W[o, i], with W held
// in one of quant.py's FORMATS (parts in FORMATS order, each [O, I / per]) and dequantized in
// registers (formats.h), so decode reads the compressed blocks once instead of a materialized
// float weight. The product drivers here are shared by the handlers' units, one per family of
// formats (q_legacy.cc, q_kquants.cc, q_float.cc), each built once per instruction set.
//
// Numerics: float32 activations and float32 (fused multiply-add) accumulation; the weights
// bit-exact (formats.h). One-row products of the block formats (dot(): decode's matvecs)
// apply each block's scale and min once to the block's sum of q * x instead: within float32
// rounding of the same sums. With the int8 attribute, x's rows are quantized to 8 bits as
// llama.cpp quantizes them (formats.h's quantize) and multiplied as integers (idot()), one
// weight row against kIntRows activation rows at a time.
//
// Work split: output rows in contiguous chunks over XLA's intra-op thread pool (plus the
// calling thread). Up to 8 activation rows: each weight block is read once, dequantized in
// registers and applied to all rows, whose accumulators stay in registers. More rows (prompt
// chunks): each weight row is dequantized once into a small buffer, then multiplied as floats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "formats.h"
#include "gemm.h"
#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxinfer::vec;
using namespace jaxinfer::formats;
using jaxinfer::dispatch;
namespace gemm = jaxinfer::gemm;
using jaxinfer::parallel_for;
using jaxinfer::static_for;
// A chunk of rows handed to another thread holds at least kMinChunkRows rows and
// kMinChunkValues weights: below either, the hand-off costs more than it saves.
constexpr int64_t kMinChunkRows = 32, kMinChunkValues = 16384;

// y[m, o0 + r step] for r < R, m < MT: R weight rows against MT activation rows (x, y already
// offset to the tile's first activation row). step 0 computes and stores one row R times.
template <class Fmt, int R, int MT>
__attribute__((noinline)) void tile(const Fmt& f, const float* x, int64_t I, int64_t O, int64_t o0,
                                    int64_t step, float* y) {
  F acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = zero();
  int64_t o[R];
  typename Fmt::Row row[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = f.row(o[r] = o0 + r * step);
  const int64_t nb = I / Fmt::kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    typename Fmt::Blk blk[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      f.prefetch(row[r], b + Fmt::kAhead);
      blk[r] = f.block(row[r], b);
    }
    const float* xb = x + b * Fmt::kBlock;
    static_for<Fmt::kBlock / 16>([&](auto g) {
      constexpr int G = decltype(g)::value;
      F w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) w[r] = f.template value<G>(blk[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        F xv = load(xb + m * I + 16 * G);
        // Load x once into a register for all R rows: gcc would fold the load into each FMA,
        // and at one 512-bit load per cycle the loads, not the FMAs, set the pace.
        if constexpr (R > 1) KEEP(xv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][m] = fma(w[r], xv, acc[r][m]);
      }
    });
  }
  if constexpr (Fmt::kTail) {
    for (int64_t col = nb * Fmt::kBlock; col < I; col += 16) {
      Mask valid = lanes(I - col);
      for (int r = 0; r < R; ++r) {
        F w = f.tail(row[r], col, valid);
        for (int m = 0; m < MT; ++m) {
          F xv = load_n(x + m * I + col, valid);
          acc[r][m] = fma(w, xv, acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) y[m * O + o[r]] = hsum(acc[r][m]);
}

// Rows o[r] of the weight dequantized into w[r * I, (r + 1) * I).
template <class Fmt, int R>
__attribute__((noinline)) void dequantize(const Fmt& f, const int64_t* o, int64_t I, float* w) {
  for (int r = 0; r < R; ++r) {
    const typename Fmt::Row row = f.row(o[r]);
    float* out = w + r * I;
    const int64_t nb = I / Fmt::kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      f.prefetch(row, b + Fmt::kAhead);
      const typename Fmt::Blk blk = f.block(row, b);
      static_for<Fmt::kBlock / 16>([&](auto g) {
        constexpr int G = decltype(g)::value;
        store(out + b * Fmt::kBlock + 16 * G, f.template value<G>(blk));
      });
    }
    if constexpr (Fmt::kTail)
      for (int64_t col = nb * Fmt::kBlock; col < I; col += 16) {
        Mask valid = lanes(I - col);
        store_n(out + col, valid, f.tail(row, col, valid));
      }
  }
}

// y[m, o[r]] for r < R, m < MT from float weight rows w + r * stride.
template <int R, int MT>
__attribute__((noinline)) void dense(const float* w, int64_t stride, const float* x, int64_t I,
                                     int64_t O, const int64_t* o, float* y) {
  F acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[r][m] = zero();
  auto step = [&](int64_t i, Mask valid) {
    F wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load_n(w + r * stride + i, valid);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      F xv = load_n(x + m * I + i, valid);
      KEEP(xv);  // one load for all R rows (see tile())
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = fma(wv[r], xv, acc[r][m]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) step(i, 0xFFFF);
  if (i < I) step(i, lanes(I - i));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) y[m * O + o[r]] = hsum(acc[r][m]);
}

// y[m, o + r] for r < 4, m < MT <= 4 from float rows w [O, I] (x, y offset to the first
// activation row): sixteen accumulators summed by one sums16. For weights that sit in cache
// (stories260K's, I = 64): per output, a quarter of tile()'s reduction work.
template <int MT>
__attribute__((noinline)) void quad(const float* w, const float* x, int64_t I, int64_t O,
                                    int64_t o, float* y) {
  F acc[16];
  static_for<16>([&](auto n) { acc[n] = zero(); });
  for (int64_t i = 0; i < I; i += 16) {  // one loop with the tail's mask
    const Mask valid = lanes(I - i);
    F wv[4];
    static_for<4>([&](auto r) { wv[r] = load_n(w + (o + r) * I + i, valid); });
    static_for<MT>([&](auto m) {
      F xv = load_n(x + m * I + i, valid);
      KEEP(xv);  // one load for all 4 rows (see tile())
      static_for<4>([&](auto r) {
        constexpr int n = slot(r, m);
        acc[n] = fma(wv[r], xv, acc[n]);
      });
    });
  }
  const F sums = sums16(acc);
  static_for<MT>(
      [&](auto m) { static_for<4>([&](auto r) { y[m * O + o + r] = sums[4 * m + r]; }); });
}

// Float weights that fit in L2 (at most kQuadValues) take quad() at 2-8 rows: their rows
// come from cache, so reading four adjacent ones at once costs nothing.
constexpr int64_t kQuadValues = int64_t{1} << 18;

// Formats with a dot(): one-row products go through it (given x's sums per 32 values
// where kSums).
template <class Fmt, class = void>
struct HasDot : std::false_type {};
template <class Fmt>
struct HasDot<Fmt, std::void_t<decltype(&Fmt::dot)>> : std::true_type {};

// Tile shapes by the register file (vec::kRegisters 16-lane values): a tile keeps its R x MT
// accumulators, its R weight vectors and one x vector in registers. With 32 (AVX-512): two
// weight rows against up to 8 x rows, float rows four at a time, dense() 2 x 8. With 8 or 4
// (AVX2, NEON, scalar), the same shapes spilled accumulators to the stack on every step (AVX2:
// quantized products at 64 rows 1.5x slower than in-graph dequantize + dot): one weight row
// against up to kNarrowRows x rows (its dequantized vector and any table beside them), float
// rows two at a time against two x rows, dense() 2 x 2.
constexpr bool kWide = kRegisters >= 32;
constexpr int kNarrowRows = kRegisters >= 8 ? 4 : 2;
constexpr int kDenseRows = kWide ? 8 : 2;

// Formats with an idot(): products with activations quantized to 8 bits (formats.h).
template <class Fmt, class = void>
struct HasIdot : std::false_type {};
template <class Fmt>
struct HasIdot<Fmt, std::void_t<decltype(Fmt::kActs)>> : std::true_type {};

// Activation rows per idot() call: each weight row's bytes are assembled once for them.
constexpr int kIntRows = 4;

// Output rows [lo, hi) for the M activation rows a (quantized to 8 bits).
template <class Fmt>
void int_rows(const Fmt& f, const Acts* a, int64_t M, int64_t O, int64_t lo, int64_t hi,
              float* y) {
  for (int64_t o = lo; o < hi; ++o)
    for (int64_t m0 = 0; m0 < M; m0 += kIntRows)
      dispatch<kIntRows>(std::min<int64_t>(kIntRows, M - m0), [&](auto mt) {
        constexpr int MT = decltype(mt)::value;
        float out[MT];
        f.template idot<MT>(o, a + m0, out);
        for (int m = 0; m < MT; ++m) y[(m0 + m) * O + o] = out[m];
      });
}

// From this many activation rows the 8-bit products run as a GEMM (gemm.h): each weight row
// unpacked once, multiplied with 16 rows per register; below, idot() per row.
constexpr int64_t kGemmRows = 9;

// x's M rows quantized for Fmt's idot() and the experts' panels, rows split over the threads,
// in the calling thread's buffers (valid until its next call).
template <class Fmt>
const Acts* quantize_all(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t I) {
  thread_local std::unique_ptr<int8_t[]> q;
  thread_local std::unique_ptr<float[]> d, s;
  thread_local std::unique_ptr<Acts[]> acts;
  thread_local int64_t capacity = 0, rows = 0;
  const int64_t blocks = I / 32;
  if (capacity < M * I) {
    q.reset(new int8_t[M * I]), d.reset(new float[M * blocks]), s.reset(new float[M * blocks]);
    capacity = M * I;
  }
  if (rows < M) acts.reset(new Acts[M]), rows = M;
  // the buffers as pointers: in the tasks, thread_local names are the task thread's own
  Acts* a = acts.get();
  int8_t* qs = q.get();
  float *ds = d.get(), *ss = s.get();
  parallel_for(pool, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      a[m] = quantize(Fmt::kActs, x + m * I, I, qs + m * I, ds + m * blocks, ss + m * blocks);
  });
  return a;
}

// y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w for the M rows of [M, I] x, the RMSNorm of
// norm.rms_norm folded into a product's input (the four or five small XLA kernels of a norm
// cost more than the products of a small model's decode step). Its sum runs in 16 lanes, not
// in XLA's order: the result may differ from XLA's norm in the last bit.
inline void rms_norm(const float* x, const float* w, int64_t M, int64_t I, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * I;
    F acc = zero();
    for (int64_t i = 0; i < I; i += 16) {
      const Mask valid = lanes(I - i);
      const F v = load_n(xm + i, valid);
      acc = fma(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(hsum(acc) / float(I) + eps);
    for (int64_t i = 0; i < I; ++i) y[m * I + i] = xm[i] * r * w[i];
  }
}

// x's M rows (RMS-normed by `norm` first where it is given) quantized for Fmt and laid out in
// the GEMM's panels (gemm.h), a row at a time through the task thread's one-row buffers: the
// panels are the only [M, I] copy (at a 512-token prompt of Llama-3-8B's shapes, the whole
// rows quantized and normed first held 19 MB more in each thread that calls). The panels are
// the calling thread's buffers, valid until its next call.
template <class Fmt>
gemm::Panels quantize_panels(ffi::ThreadPool& pool, const float* x, const float* norm, float eps,
                             int64_t M, int64_t I) {
  const int64_t P = (M + 15) / 16, blocks = I / 32;
  const gemm::PanelBuffers out = gemm::panel_buffers(M, I, gemm::Unpack<Fmt>::kSub);
  parallel_for(pool, P * 16, 16, [&](int64_t lo, int64_t hi) {
    thread_local std::unique_ptr<float[]> row, scales;  // the normed row; d, s per 32 values
    thread_local std::unique_ptr<int8_t[]> q;
    thread_local int64_t capacity = 0;
    if (capacity < I) {
      row.reset(new float[I]), scales.reset(new float[2 * blocks]), q.reset(new int8_t[I]);
      capacity = I;
    }
    for (int64_t m = lo; m < hi; ++m) {
      if (m >= M) {
        gemm::pack_row<Fmt>(nullptr, I, m, out);
        continue;
      }
      const float* xm = x + m * I;
      if (norm) rms_norm(xm, norm, 1, I, eps, row.get()), xm = row.get();
      const Acts a = quantize(Fmt::kActs, xm, I, q.get(), scales.get(), scales.get() + blocks);
      gemm::pack_row<Fmt>(&a, I, m, out);
    }
  });
  return {out.x, out.d, out.low, out.bs, P};
}

// Output rows [lo, hi) for all M activation rows.
// M = 1: one weight row at a time, all rows in one sequential stream.
// M = 2..8 (kWide): two weight rows per tile (halving the loads of x per FMA; loads, not FMAs,
// were the limit at M = 8): rows i and i + half of the range, two sequential streams that the
// prefetchers follow (adjacent rows, 768 B apart and read interleaved, halved q8_0's speed).
// Float weights: four rows per tile, from the quarters (below); from cache, quad().
// M = 2..8 (narrow): one weight row against x rows kNarrowRows at a time (the row comes again
// from L1); float weights two rows from the halves against two x rows.
// M > 8: each row pair dequantized once into a buffer, then plain float tiles of kDenseRows
// activation rows over it (fused tiles would dequantize it again for every 8 rows), the
// activation rows in blocks that stay in L2 (512 KiB of x) while the weight passes over
// them: at M = 256, I = 2048, re-reading all of x (2 MiB) from L3 per row pair was slower
// than dequantizing in the graph.
template <class Fmt>
void rows(const Fmt& f, const float* x, int64_t M, int64_t I, int64_t O, int64_t lo, int64_t hi,
          float* y, const float* sums) {
  constexpr bool kFloat = std::is_same_v<Fmt, Full>;
  if (M == 1) {
    if constexpr (HasDot<Fmt>::value)
      for (int64_t o = lo; o < hi; ++o) y[o] = f.dot(o, x, sums);
    else
      for (int64_t o = lo; o < hi; ++o) tile<Fmt, 1, 1>(f, x, I, O, o, 0, y);
    return;
  }
  // tile<Fmt, R, MT> of rows o (and o + step ...) over the M x rows, MT <= `most` at a time
  auto over_x = [&](int64_t o, int64_t step, auto r, auto most) {
    constexpr int R = decltype(r)::value;
    for (int64_t m0 = 0; m0 < M; m0 += most) {
      dispatch<decltype(most)::value>(std::min<int64_t>(most, M - m0), [&](auto mt) {
        tile<Fmt, R, decltype(mt)::value>(f, x + m0 * I, I, O, o, step, y + m0 * O);
      });
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if constexpr (kFloat && kWide)
    if (M <= 8 && O * I <= kQuadValues) {
      int64_t o = lo;
      for (; o + 4 <= hi; o += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 4)
          dispatch<4>(std::min<int64_t>(4, M - m0), [&](auto mt) {
            quad<decltype(mt)::value>(f.w, x + m0 * I, I, O, o, y + m0 * O);
          });
      for (; o < hi; ++o) over_x(o, 0, One{}, One{});  // the last rows of an odd range
      return;
    }
  if constexpr (kFloat && kWide)
    if (M <= 8) {
      // Float rows from DRAM at 2-8 rows: four weight rows per tile, from the four quarters
      // of the range (four streams), each against the x rows four at a time, the groups one
      // after the other so that the weight rows come again from L1. A chain of 24 products
      // of 86M shapes (151 MB) at 2 / 4 / 8 rows ran 1.15x / 1.26x / 1.26x faster than with
      // two weight rows per tile (4 rows: 20.7 -> 26.1 GB/s; one row: 22.9 GB/s).
      const int64_t quarter = (hi - lo) / 4;
      for (int64_t o = lo; o < lo + quarter; ++o) over_x(o, quarter, Four{}, Four{});
      for (int64_t o = lo + 4 * quarter; o < hi; ++o) over_x(o, 0, One{}, Four{});  // last 0-3
      return;
    }
  const int64_t half = (hi - lo + 1) / 2;
  if (M <= 8) {
    if constexpr (kWide)
      for (int64_t o = lo; o < lo + half; ++o) {
        const int64_t step = o + half < hi ? half : 0;  // an odd count's middle row: twice
        dispatch<8>(M, [&](auto mt) { tile<Fmt, 2, decltype(mt)::value>(f, x, I, O, o, step, y); });
      }
    else if constexpr (kFloat)
      for (int64_t o = lo; o < lo + half; ++o) over_x(o, o + half < hi ? half : 0, Two{}, Two{});
    else
      for (int64_t o = lo; o < hi; ++o)
        over_x(o, 0, One{}, std::integral_constant<int, kNarrowRows>{});
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
      if constexpr (kFloat)
        rows = f.w + os[0] * I, stride = (os[1] - os[0]) * I;
      else
        dequantize<Fmt, 2>(f, os, I, w);
      for (int64_t m0 = mb; m0 < std::min(M, mb + block); m0 += kDenseRows)
        dispatch<kDenseRows>(std::min<int64_t>(kDenseRows, M - m0), [&](auto mt) {
          dense<2, decltype(mt)::value>(rows, stride, x + m0 * I, I, O, os, y + m0 * O);
        });
    }
}

// One format's parts, in FORMATS order: their dtypes, values per entry (0: one entry per
// weight row), and the format made from their data.
template <class Fmt>
struct Spec;
#define SPEC(Fmt, TYPES, PER, ...)                                                \
  template <>                                                                     \
  struct Spec<Fmt> {                                                              \
    static constexpr ffi::DataType kTypes[] = {TYPES};                            \
    static constexpr int64_t kPer[] = {PER};                                      \
    static Fmt make(const void* const* p, int64_t I) { return {__VA_ARGS__, I}; } \
  };
#define P(k, T) static_cast<const T*>(p[k])
#define LIST(...) __VA_ARGS__
using ffi::DataType;

// The format over the parts' rows from row0 on (parts at `base`, each [rows, I / per]).
template <class Fmt>
Fmt from_row(const void* const* base, int64_t I, int64_t row0) {
  using S = Spec<Fmt>;
  const void* p[std::size(S::kTypes)];
  for (size_t k = 0; k < std::size(S::kTypes); ++k)
    p[k] = static_cast<const char*>(base[k]) +
           row0 * (S::kPer[k] ? I / S::kPer[k] : 1) * int64_t(ffi::ByteWidth(S::kTypes[k]));
  return S::make(p, I);
}

// A stacked weight (depth-shared layers: parts [copies, rows, ...]) is read at one layer's
// rows: its first row for `entries` entries per part (copies * rows * entries in all), or an
// error when the part does not hold whole layers or `layer` lies outside them.
inline bool stacked_row(int64_t count, int64_t entries, int64_t rows, int32_t layer,
                        int64_t& row0) {
  if (entries <= 0 || count % entries) return false;
  const int64_t copies = count / entries;
  if (layer < 0 || layer >= copies) return false;
  row0 = int64_t(layer) * rows;
  return true;
}

// Most weights one call multiplies x by (QKV and gate/up share their input).
constexpr size_t kMaxWeights = 8;

// x [M, I] times W weights (the parts of weight w at [w * P, (w + 1) * P)) -> y_w [M, O_w].
// Their output rows are split over the threads as one range, so that the weights sharing an
// input cost one call and one join: 86M decode's product chain ran 1.08x faster with QKV and
// gate/up each one call.
// With glu (two weights, gate and up, of one width F; 8-bit activations, kGemmRows rows or
// more): one result silu(x gate^T) * (x up^T) [M, F], made a few output rows at a time, so
// that the [M, F] products of gate and up are never held (at a 512-token prompt of
// Llama-3-8B's shapes, 59 MB of the program's temporaries).
template <class Fmt>
ffi::Error run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
               ffi::RemainingArgs parts, ffi::RemainingRets ys, float eps, int32_t int8,
               int32_t glu) {
  using S = Spec<Fmt>;
  constexpr size_t P = std::size(S::kTypes);
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x must be [M, I]");
  const int64_t M = xd[0], I = xd[1];
  if (I % Fmt::kBlock && !Fmt::kTail)
    return ffi::Error::InvalidArgument("qmatmul: I = " + std::to_string(I) +
                                       " is not a multiple of the block");
  const size_t W = glu ? 2 : ys.size();
  if (W == 0 || W > kMaxWeights || parts.size() != W * P + (eps > 0) || (glu && ys.size() != 1))
    return ffi::Error::InvalidArgument(
        "qmatmul: expected 1 to 8 results (glu: one, of two weights), each weight with its "
        "parts, then the norm weight if eps > 0");
  struct Out {
    Fmt f;
    float* y;
    int64_t O, at;  // its rows, and where they start in the call's range
  };
  Out outs[kMaxWeights];
  int64_t total = 0;
  for (size_t w = 0; w < W; ++w) {
    auto y = ys.get<ffi::AnyBuffer>(glu ? 0 : w);
    if (!y.has_value()) return y.error();
    auto yd = y.value()->dimensions();
    if (y.value()->element_type() != DataType::F32 || yd.size() != 2 || yd[0] != M)
      return ffi::Error::InvalidArgument("qmatmul: each y must be float32 [M, O]");
    const int64_t O = yd[1];
    const void* p[P];
    int64_t row0 = 0;
    for (size_t k = 0; k < P; ++k) {
      auto a = parts.get<ffi::AnyBuffer>(w * P + k);
      if (!a.has_value()) return a.error();
      const int64_t per = S::kPer[k];
      if (a.value().element_type() != S::kTypes[k] ||
          !stacked_row(a.value().element_count(), per ? O * (I / per) : O, O,
                       layer.typed_data()[0], row0))
        return ffi::Error::InvalidArgument("qmatmul: a part's dtype or size does not match");
      p[k] = a.value().untyped_data();
    }
    outs[w] = Out{from_row<Fmt>(p, I, row0), y.value()->typed_data<float>(), O, total};
    total += O;
  }
  if (glu && (!int8 || M < kGemmRows || I == 0 || !HasIdot<Fmt>::value))
    return ffi::Error::InvalidArgument("qmatmul: glu needs 8-bit activations, a block format, "
                                       "at least " + std::to_string(kGemmRows) + " rows and I > 0");
  if (M == 0 || total == 0) return ffi::Error::Success();
  // the weights' output rows as one range split over the threads (I > 0): product(out, lo,
  // hi) makes rows [lo, hi) of one weight's result
  const int64_t chunk = std::max(kMinChunkRows, kMinChunkValues / std::max<int64_t>(I, 1));
  auto each_out = [&](auto product) {
    parallel_for(pool, total, chunk, [&](int64_t lo, int64_t hi) {
      for (size_t w = 0; w < W; ++w) {
        const Out& o = outs[w];
        const int64_t a = std::max(lo, o.at), b = std::min(hi, o.at + o.O);
        if (a < b) product(o, a - o.at, b - o.at);
      }
    });
  };
  const float* xp = x.typed_data();
  const float* norm = nullptr;  // the fused RMS norm's weight [I]
  if (eps > 0) {
    auto w = parts.get<ffi::AnyBuffer>(W * P);
    if (!w.has_value()) return w.error();
    if (w.value().element_type() != DataType::F32 || int64_t(w.value().element_count()) != I)
      return ffi::Error::InvalidArgument("qmatmul: the norm weight must be float32 [I]");
    norm = static_cast<const float*>(w.value().untyped_data());
  }
  if constexpr (HasIdot<Fmt>::value)
    if (int8 && M >= kGemmRows && I > 0) {  // the rows normed as they are quantized
      const gemm::Panels panels = quantize_panels<Fmt>(pool, xp, norm, eps, M, I);
      if (glu) {
        const Out &gate = outs[0], &up = outs[1];
        const int64_t width = gate.O, R = gemm::chunk_rows<Fmt>(I);  // R output rows at a time
        parallel_for(pool, width, chunk, [&](int64_t lo, int64_t hi) {
          thread_local std::unique_ptr<float[]> ups;  // up's [M, R] rows of the step
          thread_local int64_t capacity = 0;
          if (capacity < M * R) ups.reset(new float[capacity = M * R]);
          for (int64_t a = lo; a < hi; a += R) {
            const int64_t b = std::min(hi, a + R), n = b - a;
            gemm::rows(gate.f, panels, M, I, width, a, b, gate.y);  // y[m, o] = gate's, in place
            // up's rows [a, b) at ups[m * n + o - a]: rows() writes y[m * O + o], O = n
            gemm::rows(up.f, panels, M, I, n, a, b, ups.get() - a);
            for (int64_t m = 0; m < M; ++m)  // y = silu(g) * up = g / (1 + e^-g) * up
              for (int64_t o = a; o < b; o += 16) {
                const Mask valid = lanes(b - o);
                const F g = load_n(gate.y + m * width + o, valid);
                const F u = load_n(ups.get() + m * n + o - a, valid);
                store_n(gate.y + m * width + o, valid, g / (exp16(-g) + 1.0f) * u);
              }
          }
        });
        return ffi::Error::Success();
      }
      each_out([&](const Out& o, int64_t a, int64_t b) {
        gemm::rows(o.f, panels, M, I, o.O, a, b, o.y);
      });
      return ffi::Error::Success();
    }
  if (norm) {
    thread_local std::unique_ptr<float[]> normed;
    thread_local int64_t capacity = 0;
    if (capacity < M * I + 16) normed.reset(new float[capacity = M * I + 16]);
    // 64-byte aligned, as XLA's buffers are: x rows split across cache lines made the 4-row
    // tiles 7% slower at the 86M's shapes
    float* y = normed.get() + (16 - reinterpret_cast<uintptr_t>(normed.get()) / 4 % 16) % 16;
    rms_norm(xp, norm, M, I, eps, y);
    xp = y;  // read by the tasks below, which end before this call returns
  }
  if (I == 0) {
    for (size_t w = 0; w < W; ++w) std::fill(outs[w].y, outs[w].y + M * outs[w].O, 0.0f);
    return ffi::Error::Success();
  }
  if (int8) {
    if constexpr (HasIdot<Fmt>::value) {
      const Acts* acts = quantize_all<Fmt>(pool, xp, M, I);
      each_out([&](const Out& o, int64_t a, int64_t b) { int_rows(o.f, acts, M, o.O, a, b, o.y); });
      return ffi::Error::Success();
    }
    return ffi::Error::InvalidArgument("qmatmul: 8-bit activations need a GGUF block format");
  }
  const float* sums = nullptr;  // x's sums per 32 values, for a format's one-row dot()
  if constexpr (HasDot<Fmt>::value)
    if (Fmt::kSums && M == 1) {
      thread_local std::unique_ptr<float[]> buffer;
      thread_local int64_t capacity = 0;
      if (capacity < I / 32) buffer.reset(new float[capacity = I / 32]);
      for (int64_t j = 0; j < I / 32; ++j)
        buffer[j] = hsum(load(xp + 32 * j) + load(xp + 32 * j + 16));
      sums = buffer.get();
    }
  each_out([&](const Out& o, int64_t a, int64_t b) { rows(o.f, xp, M, I, o.O, a, b, o.y, sums); });
  return ffi::Error::Success();
}

// Bindings: the thread pool, x, the layer (int32 [], 0 unless the parts are stacked), the
// weights' parts (then the norm weight); the results; eps, int8 (nonzero: x quantized to 8
// bits as llama.cpp does, integer products) and glu (nonzero: silu(gate) * up, run's).
auto with() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets().Attr<float>("eps")
      .Attr<int32_t>("int8").Attr<int32_t>("glu");
}

// The expert block's products: x [A, I] (rows sorted by expert; counts [E] rows per expert)
// times each of up to kMaxWeights stacked weights [E, O_w, I] -> y_w [A, O_w]. Expert e's rows
// [s_e, s_e + n_e) multiply its weight in place (as run() multiplies one weight: 8-bit
// activations quantized once for all rows, a GEMM for an expert with kGemmRows or more);
// experts without rows are never read (decode reads the k experts a token routes to, as
// llama.cpp's mul_mat_id). Rows from sum(counts) on (other devices' experts, padding) are 0.
// The work split over the threads: the output rows of every (weight, expert with rows).
template <class Fmt>
ffi::Error run_grouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs parts, ffi::RemainingRets ys, int32_t int8) {
  using S = Spec<Fmt>;
  constexpr size_t P = std::size(S::kTypes);
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("qmatmul_grouped: x must be [A, I]");
  const int64_t A = xd[0], I = xd[1], E = int64_t(counts.element_count());
  if (I % Fmt::kBlock && !Fmt::kTail)
    return ffi::Error::InvalidArgument("qmatmul_grouped: I is not a multiple of the block");
  const size_t W = ys.size();
  if (W == 0 || W > kMaxWeights || parts.size() != W * P)
    return ffi::Error::InvalidArgument("qmatmul_grouped: expected 1 to 8 results and parts");
  struct Weight {
    const void* p[P];
    float* y;
    int64_t O, row0;  // row0: the layer's first row of a stacked weight
  };
  Weight ws[kMaxWeights];
  for (size_t w = 0; w < W; ++w) {
    auto y = ys.get<ffi::AnyBuffer>(w);
    if (!y.has_value()) return y.error();
    auto yd = y.value()->dimensions();
    if (y.value()->element_type() != DataType::F32 || yd.size() != 2 || yd[0] != A)
      return ffi::Error::InvalidArgument("qmatmul_grouped: each y must be float32 [A, O]");
    ws[w].y = y.value()->typed_data<float>(), ws[w].O = yd[1];
    for (size_t k = 0; k < P; ++k) {
      auto a = parts.get<ffi::AnyBuffer>(w * P + k);
      if (!a.has_value()) return a.error();
      const int64_t per = S::kPer[k], rows = E * ws[w].O;
      if (a.value().element_type() != S::kTypes[k] ||
          !stacked_row(a.value().element_count(), per ? rows * (I / per) : rows, rows,
                       layer.typed_data()[0], ws[w].row0))
        return ffi::Error::InvalidArgument("qmatmul_grouped: a part's dtype or size differs");
      ws[w].p[k] = a.value().untyped_data();
    }
  }
  // experts' first rows; counts past A (a corrupt routing) are cut, never read past x
  thread_local std::unique_ptr<int64_t[]> first_, rows_;
  thread_local int64_t capacity = 0;
  if (capacity < E + 1) first_.reset(new int64_t[E + 1]), rows_.reset(new int64_t[E]), capacity = E + 1;
  int64_t* first = first_.get();
  int64_t* n = rows_.get();
  first[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    n[e] = std::clamp<int64_t>(counts.typed_data()[e], 0, A - first[e]);
    first[e + 1] = first[e] + n[e];
  }
  const int64_t filled = first[E];
  for (size_t w = 0; w < W; ++w)
    std::fill(ws[w].y + filled * ws[w].O, ws[w].y + A * ws[w].O, 0.0f);
  int64_t total = 0;  // the output rows of every (weight, expert with rows)
  for (size_t w = 0; w < W; ++w)
    for (int64_t e = 0; e < E; ++e) total += n[e] ? ws[w].O : 0;
  if (total == 0 || I == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  // 8-bit activations: quantized once; experts with kGemmRows rows or more in panels of their
  // own (each expert's rows from a panel's start)
  const Acts* acts = nullptr;
  thread_local std::unique_ptr<int64_t[]> panel_;
  thread_local int64_t panel_cap = 0;
  if (panel_cap < E + 1) panel_.reset(new int64_t[E + 1]), panel_cap = E + 1;
  int64_t* panel = panel_.get();  // expert e's first panel
  gemm::PanelBuffers packed{};
  if constexpr (HasIdot<Fmt>::value) {
    if (int8) {
      acts = quantize_all<Fmt>(pool, xp, A, I);
      panel[0] = 0;
      for (int64_t e = 0; e < E; ++e)
        panel[e + 1] = panel[e] + (n[e] >= kGemmRows ? (n[e] + 15) / 16 : 0);
      if (panel[E]) {
        const int64_t J = I / gemm::Unpack<Fmt>::kSub;  // sub-blocks per row
        packed = gemm::panel_buffers(16 * panel[E], I, gemm::Unpack<Fmt>::kSub);
        parallel_for(pool, E, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t e = lo; e < hi; ++e)
            for (int64_t m = 0; m < 16 * (panel[e + 1] - panel[e]); ++m)
              gemm::pack_row<Fmt>(m < n[e] ? acts + first[e] + m : nullptr, I, m, gemm::PanelBuffers{
                  packed.x + panel[e] * 16 * I, packed.d + panel[e] * 16 * J,
                  packed.low + panel[e] * 16 * J, packed.bs + panel[e] * 16 * (J / 2)});
        });
      }
    }
  } else if (int8) {
    return ffi::Error::InvalidArgument("qmatmul_grouped: 8-bit activations need a block format");
  }
  const float* sums = nullptr;  // each row's sums per 32 values, for a one-row dot()
  if constexpr (HasDot<Fmt>::value)
    if (Fmt::kSums && !int8) {
      thread_local std::unique_ptr<float[]> buffer;
      thread_local int64_t cap = 0;
      if (cap < A * (I / 32)) buffer.reset(new float[cap = A * (I / 32)]);
      for (int64_t m = 0; m < A; ++m)
        for (int64_t j = 0; j < I / 32; ++j)
          buffer[m * (I / 32) + j] = hsum(load(xp + m * I + 32 * j) + load(xp + m * I + 32 * j + 16));
      sums = buffer.get();
    }
  const int64_t chunk = std::max(kMinChunkRows, kMinChunkValues / I);
  parallel_for(pool, total, chunk, [&](int64_t lo, int64_t hi) {
    int64_t at = 0;  // the range's start of the current (weight, expert)
    for (size_t w = 0; w < W; ++w)
      for (int64_t e = 0; e < E && at < hi; ++e) {
        if (!n[e]) continue;
        const int64_t O = ws[w].O, a = std::max(lo, at) - at, b = std::min(hi, at + O) - at;
        at += O;
        if (a >= b) continue;
        const Fmt f = from_row<Fmt>(ws[w].p, I, ws[w].row0 + e * O);
        float* y = ws[w].y + first[e] * O;
        if constexpr (HasIdot<Fmt>::value)
          if (int8) {
            if (n[e] >= kGemmRows) {
              const int64_t J = I / gemm::Unpack<Fmt>::kSub;
              const int64_t at = panel[e] * 16;  // the expert's first panel row
              const gemm::Panels pe{packed.x + at * I, packed.d + at * J, packed.low + at * J,
                                    packed.bs + at * (J / 2), panel[e + 1] - panel[e]};
              gemm::rows(f, pe, n[e], I, O, a, b, y);
            } else {
              int_rows(f, acts + first[e], n[e], O, a, b, y);
            }
            continue;
          }
        rows(f, xp + first[e] * I, n[e], I, O, a, b, y, sums ? sums + first[e] * (I / 32) : nullptr);
      }
  });
  return ffi::Error::Success();
}

// Bindings: the thread pool, x, counts, the layer, the weights' parts; the results; int8.
auto with_grouped() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs()
      .RemainingRets().Attr<int32_t>("int8");
}

}  // namespace

// The handlers of format Fmt, named qmatmul_<name> and qmatmul_grouped_<name> in the library.
#define QMATMUL_HANDLER(name, Fmt)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_##name, run<Fmt>, with());                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(qmatmul_grouped_##name, run_grouped<Fmt>, with_grouped());
