// Shared by the CPU kernels: compile-time loops and a 16-way horizontal sum (AVX-512).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <utility>

#define INLINE inline __attribute__((always_inline))
// For the bodies handed to static_for, `[&](auto i) UNROLLED { ... }`: inlined before gcc's
// scalar replacement runs, so that the register arrays they index stay registers. Without it
// attend.cc's head() kept its 16 score accumulators in registers but also stored all of them
// to the stack on every step of the head-dim loop (16 stores per 16 FMAs).
#define UNROLLED __attribute__((always_inline))

namespace jaxinfer {

// The first min(n, 16) of 16 lanes (n >= 0): a row's tail in masked loads.
INLINE __mmask16 lanes(int64_t n) { return __mmask16((1u << (n < 16 ? n : 16)) - 1); }

template <class F, int... G>
INLINE void static_for_impl(F&& f, std::integer_sequence<int, G...>) {
  (f(std::integral_constant<int, G>{}), ...);
}

// f(std::integral_constant<int, g>) for g in [0, N): block bodies unrolled with constant g.
template <int N, class F>
INLINE void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// The 16 horizontal sums of v[0..15] in one vector, lane 4 m + r holding the sum of
// v[slot(r, m)]: a transpose-and-add tree of 45 shuffles and adds, where 16 separate
// reductions take about 130. Indices are compile-time constants throughout (static_for), so
// that gcc keeps the arrays in registers.
INLINE constexpr int swap12(int i) { return i == 1 ? 2 : i == 2 ? 1 : i; }
INLINE constexpr int slot(int r, int m) { return swap12(r) + 4 * swap12(m); }
INLINE __m512 sums16(const __m512 (&v)[16]) {
  __m512 w[8], z[4], p[2];
  static_for<8>([&](auto k) {  // 128-bit lanes 0, 1: v[k]; 2, 3: v[k + 8]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44),
                         _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
  });
  static_for<4>([&](auto k) {  // lanes: v[k], v[k + 8], v[k + 4], v[k + 12]
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[k], w[k + 4], 0x88),
                         _mm512_shuffle_f32x4(w[k], w[k + 4], 0xDD));
  });
  static_for<2>([&](auto k) {  // within a lane: z[k], z[k + 2], z[k], z[k + 2]
    p[k] = _mm512_add_ps(_mm512_unpacklo_ps(z[k], z[k + 2]),
                         _mm512_unpackhi_ps(z[k], z[k + 2]));
  });
  // within a lane: z[0], z[2], z[1], z[3]
  return _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x44),
                       _mm512_shuffle_ps(p[0], p[1], 0xEE));
}

}  // namespace jaxinfer
