// The CPU kernels' vector API: 16 float32 (or int32) lanes, the width of every GGUF block's
// sub-groups, and the few operations the kernels need. Written once with operators on whole
// vectors (+ - * & | >> << and comparisons): gcc's vector extensions, one zmm, on AVX-512;
// elsewhere Lanes, two ymm (AVX2) or four 128-bit registers (NEON, SSE2 for the scalar x86
// build), each part a gcc vector. One body per instruction set only where the generic form is
// slow or inexact: fused multiply-add, horizontal sums, f16 conversion, byte widening, table
// lookups, lane masks, the exp's rounding and scaling. The variant is chosen by the compiler
// flags of its build (kernels/cpu/build.py: -mavx512f ..., -mavx2 -mfma -mf16c, aarch64's NEON,
// none), never by -march=native. Reading the assembly of a hot loop is how a slow generic form
// shows (values round-tripping through the stack, bytes moved through general registers).
#pragma once

#if defined(JAXINFER_SCALAR)  // the generic bodies only, whatever the target
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#define JAXINFER_AVX512 1
#if defined(__AVX512VNNI__)  // vpdpbusd: the GEMM's 8-bit products in one instruction
#define JAXINFER_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXINFER_AVX2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define JAXINFER_NEON 1
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(JAXINFER_NEON)
#include <arm_neon.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define INLINE inline __attribute__((always_inline))
// For the bodies handed to static_for, `[&](auto i) UNROLLED { ... }`: inlined before gcc's
// scalar replacement runs, so that the register arrays they index stay registers. Without it
// attend.cc's head() kept its 16 score accumulators in registers but also stored all of them
// to the stack on every step of the head-dim loop (16 stores per 16 FMAs).
#define UNROLLED __attribute__((always_inline))

namespace jaxinfer {

// The variant's name, as kernels/cpu/ reports it (the library's `variant()` symbol).
#if defined(JAXINFER_VNNI)
constexpr const char* kVariant = "avx512vnni";
#elif defined(JAXINFER_AVX512)
constexpr const char* kVariant = "avx512";
#elif defined(JAXINFER_AVX2)
constexpr const char* kVariant = "avx2";
#elif defined(JAXINFER_NEON)
constexpr const char* kVariant = "neon";
#else
constexpr const char* kVariant = "scalar";
#endif

template <class F, int... G>
INLINE void static_for_impl(F&& f, std::integer_sequence<int, G...>) {
  (f(std::integral_constant<int, G>{}), ...);
}

// f(std::integral_constant<int, g>) for g in [0, N): block bodies unrolled with constant g.
template <int N, class F>
INLINE void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// fn(std::integral_constant<int, n>{}) for a run-time n in [1, N].
template <int N, class Fn>
INLINE void dispatch(int64_t n, Fn&& fn) {
  static_for<N>([&](auto k) {
    if (n == k + 1) fn(std::integral_constant<int, k + 1>{});
  });
}

namespace vec {

// 16 lanes. With AVX-512 they are one register, and gcc's vector extensions are the type.
// Without it gcc has no machine mode for a 64-byte vector and keeps every such value in
// memory (each operation a round trip through the stack: the AVX2 kernels ran 2-5x slower
// than the scalar build). There 16 lanes are Lanes: kParts native vectors, each a register,
// with the same operators.
#if defined(JAXINFER_AVX512)
typedef float F __attribute__((vector_size(64), aligned(4)));      // 16 float32 lanes
typedef int32_t Int __attribute__((vector_size(64), aligned(4)));    // 16 int32 lanes
typedef uint32_t UInt __attribute__((vector_size(64), aligned(4)));   // 16 uint32 lanes
#else
#if defined(JAXINFER_AVX2)
constexpr int kNative = 32;  // bytes of a native vector: one ymm
#else
constexpr int kNative = 16;  // NEON's q registers; SSE2's xmm on the scalar x86 build
#endif
template <class T>
struct Lanes {
  static constexpr int kPer = kNative / int(sizeof(T)), kParts = 16 / kPer;
  typedef T N __attribute__((vector_size(kNative)));
  N p[kParts];
  INLINE T operator[](int l) const { return p[l / kPer][l % kPer]; }
  INLINE void set(int l, T v) { p[l / kPer][l % kPer] = v; }
};
typedef Lanes<float> F;       // 16 float32 lanes
typedef Lanes<int32_t> Int;   // 16 int32 lanes
typedef Lanes<uint32_t> UInt; // 16 uint32 lanes

// r.p[k] = op(a.p[k], ...) for every part: the operators' one body.
template <class R, class Op, class... A>
INLINE R each(Op op, const A&... a) {
  R r;
  static_for<R::kParts>([&](auto k) UNROLLED { r.p[k] = op(a.p[k]...); });
  return r;
}
template <class T>
using Scalar = std::enable_if_t<std::is_arithmetic_v<T>, T>;
#define JAXINFER_LANES_OP(op)                                                             \
  template <class T>                                                                      \
  INLINE Lanes<T> operator op(const Lanes<T>& a, const Lanes<T>& b) {                     \
    return each<Lanes<T>>([](auto x, auto y) UNROLLED { return x op y; }, a, b);           \
  }                                                                                       \
  template <class T, class S, class = Scalar<S>>                                          \
  INLINE Lanes<T> operator op(const Lanes<T>& a, S b) {                                   \
    return each<Lanes<T>>([b](auto x) UNROLLED { return x op T(b); }, a);                  \
  }                                                                                       \
  template <class T, class S, class = Scalar<S>>                                          \
  INLINE Lanes<T> operator op(S a, const Lanes<T>& b) {                                   \
    return each<Lanes<T>>([a](auto y) UNROLLED { return T(a) op y; }, b);                  \
  }
JAXINFER_LANES_OP(+)
JAXINFER_LANES_OP(-)
JAXINFER_LANES_OP(*)
JAXINFER_LANES_OP(/)
JAXINFER_LANES_OP(&)
JAXINFER_LANES_OP(|)
JAXINFER_LANES_OP(>>)
JAXINFER_LANES_OP(<<)
#undef JAXINFER_LANES_OP
// Comparisons: int32 lanes of all ones where true, zeros where false (as gcc's vectors).
#define JAXINFER_LANES_CMP(op)                                                            \
  template <class T>                                                                      \
  INLINE Int operator op(const Lanes<T>& a, const Lanes<T>& b) {                          \
    return each<Int>([](auto x, auto y) UNROLLED { return Int::N(x op y); }, a, b);        \
  }                                                                                       \
  template <class T, class S, class = Scalar<S>>                                          \
  INLINE Int operator op(const Lanes<T>& a, S b) {                                        \
    return each<Int>([b](auto x) UNROLLED { return Int::N(x op T(b)); }, a);               \
  }
JAXINFER_LANES_CMP(<)
JAXINFER_LANES_CMP(>)
JAXINFER_LANES_CMP(==)
JAXINFER_LANES_CMP(!=)
#undef JAXINFER_LANES_CMP
template <class T>
INLINE Lanes<T> operator-(const Lanes<T>& a) {
  return each<Lanes<T>>([](auto x) UNROLLED { return -x; }, a);
}
#endif
typedef float F8 __attribute__((vector_size(32), aligned(4)));     // 8 float32 lanes
typedef uint8_t B16 __attribute__((vector_size(16), aligned(1)));  // 16 bytes
typedef int8_t S16 __attribute__((vector_size(16), aligned(1)));
typedef uint16_t H16 __attribute__((vector_size(32), aligned(2)));  // 16 halves
typedef uint8_t B64 __attribute__((vector_size(64), aligned(1)));   // 64 bytes
typedef uint8_t B32 __attribute__((vector_size(32), aligned(1)));
typedef uint32_t Mask;  // lane l: bit l (16 lanes)

INLINE F zero() { return F{}; }
INLINE F set1(float x) { return F{} + x; }
INLINE Int set1i(int32_t x) { return Int{} + x; }
// Unaligned loads and stores of 16 lanes (memcpy: gcc makes it one load per register).
template <class V, class T>
INLINE V load_as(const T* p) {
  V r;
  std::memcpy(&r, p, sizeof(V));
  return r;
}
#if defined(JAXINFER_AVX512)
INLINE F load(const float* p) { return load_as<F>(p); }
INLINE void store(float* p, F v) { std::memcpy(p, &v, 64); }
#else
INLINE F load(const float* p) {  // part by part: gcc keeps each in a register
  F r;
  static_for<F::kParts>([&](auto k) UNROLLED { r.p[k] = load_as<F::N>(p + k * F::kPer); });
  return r;
}
INLINE void store(float* p, F v) {
  static_for<F::kParts>([&](auto k) UNROLLED { std::memcpy(p + k * F::kPer, &v.p[k], kNative); });
}
#endif
INLINE F8 load8(const float* p) { return load_as<F8>(p); }
INLINE F iota(float base) {
  static constexpr float kLanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return load(kLanes) + base;
}
#if defined(JAXINFER_AVX512)
INLINE Int to_int(F v) { return __builtin_convertvector(v, Int); }
INLINE F to_float(Int v) { return __builtin_convertvector(v, F); }
INLINE F bits_float(UInt v) { return reinterpret_cast<F&>(v); }
INLINE F bits_float(Int v) { return reinterpret_cast<F&>(v); }
// 16 consecutive bytes (or halves) widened to 16 int32 lanes.
// (vpmovzxbd / vpmovsxbd: gcc's generic conversion of a 16-byte vector built the lanes a byte
// at a time through general registers, and a q8_0 KV read ran 8x slower than a float16 one)
INLINE Int u8x16(const uint8_t* p) {
  return Int(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
INLINE Int s8x16(const int8_t* p) {
  return Int(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
INLINE UInt u16x16(const uint16_t* p) { return __builtin_convertvector(load_as<H16>(p), UInt); }
// m where (all ones), else no: lane by lane.
INLINE F where(Int m, F yes, F no) { return m ? yes : no; }
#else
INLINE Int to_int(F v) {
  return each<Int>([](auto x) UNROLLED { return __builtin_convertvector(x, Int::N); }, v);
}
INLINE F to_float(Int v) {
  return each<F>([](auto x) UNROLLED { return __builtin_convertvector(x, F::N); }, v);
}
INLINE F bits_float(UInt v) { return each<F>([](auto x) UNROLLED { return F::N(x); }, v); }
INLINE F bits_float(Int v) { return each<F>([](auto x) UNROLLED { return F::N(x); }, v); }
// kPer consecutive narrow values widened to the lanes of each part.
template <class V, class T>
INLINE V widen(const T* p) {
  typedef T Part __attribute__((vector_size(sizeof(T) * V::kPer), aligned(1)));
  V r;
  static_for<V::kParts>([&](auto k) UNROLLED {
    r.p[k] = __builtin_convertvector(load_as<Part>(p + k * V::kPer), typename V::N);
  });
  return r;
}
// 16 consecutive bytes (or halves) widened to 16 int32 lanes: vpmovsx / vmovl, where the
// generic form (8-byte parts) went through a general register byte by byte.
#if defined(JAXINFER_AVX2)
INLINE __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
INLINE Int u8x16(const uint8_t* p) {
  const __m128i b = load16(p);
  return Int{{Int::N(_mm256_cvtepu8_epi32(b)), Int::N(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b)))}};
}
INLINE Int s8x16(const int8_t* p) {
  const __m128i b = load16(p);
  return Int{{Int::N(_mm256_cvtepi8_epi32(b)), Int::N(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)))}};
}
INLINE UInt u16x16(const uint16_t* p) {
  return UInt{{UInt::N(_mm256_cvtepu16_epi32(load16(p))), UInt::N(_mm256_cvtepu16_epi32(load16(p + 8)))}};
}
#elif defined(JAXINFER_NEON)
INLINE Int u8x16(const uint8_t* p) {
  const uint8x16_t b = vld1q_u8(p);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
  return Int{{Int::N(vmovl_u16(vget_low_u16(lo))), Int::N(vmovl_high_u16(lo)),
              Int::N(vmovl_u16(vget_low_u16(hi))), Int::N(vmovl_high_u16(hi))}};
}
INLINE Int s8x16(const int8_t* p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  return Int{{Int::N(vmovl_s16(vget_low_s16(lo))), Int::N(vmovl_high_s16(lo)),
              Int::N(vmovl_s16(vget_low_s16(hi))), Int::N(vmovl_high_s16(hi))}};
}
INLINE UInt u16x16(const uint16_t* p) {
  const uint16x8_t lo = vld1q_u16(p), hi = vld1q_u16(p + 8);
  return UInt{{UInt::N(vmovl_u16(vget_low_u16(lo))), UInt::N(vmovl_high_u16(lo)),
               UInt::N(vmovl_u16(vget_low_u16(hi))), UInt::N(vmovl_high_u16(hi))}};
}
#else
INLINE Int u8x16(const uint8_t* p) { return widen<Int>(p); }
INLINE Int s8x16(const int8_t* p) { return widen<Int>(p); }
INLINE UInt u16x16(const uint16_t* p) { return widen<UInt>(p); }
#endif
// m where (all ones), else no: lane by lane.
INLINE F where(Int m, F yes, F no) {
  return each<F>([](auto c, auto y, auto n) UNROLLED { return c ? y : n; }, m, yes, no);
}
#endif
// 16 consecutive int8 as 16 float32 lanes (a q8_0 KV pool's values): each variant's s8x16
// widening (vpmovsxbd, vmovl), then one conversion per part.
INLINE F s8_float(const int8_t* p) { return to_float(s8x16(p)); }
// 8 consecutive bytes as 8 float32 lanes (the K-quants' sub-block scales).
INLINE F8 u8x8(const uint8_t* p) {
#if defined(JAXINFER_AVX512) || defined(JAXINFER_AVX2)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return F8(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
#else
  typedef uint8_t B8 __attribute__((vector_size(8), aligned(1)));
  return __builtin_convertvector(load_as<B8>(p), F8);
#endif
}
// The first min(n, 16) of 16 lanes (n >= 0): a row's tail.
INLINE Mask lanes(int64_t n) { return (1u << (n < 16 ? n : 16)) - 1; }
// Lane l of the mask as a vector lane of all ones (or zeros).
INLINE Int expand(Mask m) {
  const Int bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  return (bit & int32_t(m)) != 0;
}
// Lanes of 16 bytes whose `bit` is set.
INLINE Mask test_bytes(const uint8_t* p, uint8_t bit);

// Hint to load the line holding p[i] (past the end is harmless: prefetches never fault).
template <class T>
INLINE void prefetch(const T* p, int64_t i, int locality = 3) {
  if (locality == 3)
    __builtin_prefetch(p + i, 0, 3);
  else
    __builtin_prefetch(p + i, 0, 2);
}

// The 16-lane values the vector register file holds (32 zmm; 16 ymm or 32 q registers; 16
// xmm on the scalar x86 build): what the product tiles size their accumulators by.
#if defined(JAXINFER_AVX512)
constexpr int kRegisters = 32;
#elif defined(JAXINFER_AVX2) || defined(JAXINFER_NEON)
constexpr int kRegisters = 8;
#else
constexpr int kRegisters = 4;
#endif

// A register barrier: v is kept in registers and loaded once for the uses that follow (gcc
// would fold the load into each FMA, and at one load per cycle the loads would set the pace).
#if defined(JAXINFER_AVX512)
#define KEEP(v) asm("" : "+v"(v))
#else
#define KEEP(v) ((void)0)
#endif

// f16 <-> f32, one value (exact widening; narrowing rounds to nearest even).
INLINE float h2f_soft(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m << 13);  // inf, nan
  } else if (e) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {  // subnormal: m 2^-24, exact in float32
    float f = float(m) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
INLINE uint16_t f2h_soft(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00 | uint16_t((a >> 13) & 0x3FF);  // nan stays nan
  if (a >= 0x477FF000u) return sign | 0x7C00;  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below f16's smallest normal: a multiple of 2^-24, rounded
    float f;
    std::memcpy(&f, &a, 4);
    return sign | uint16_t(std::nearbyint(f * 16777216.0f));
  }
  const uint32_t r = a + 0xFFFu + ((a >> 13) & 1);  // round to nearest even at bit 13
  return sign | uint16_t((r - 0x38000000u) >> 13);
}

#if defined(JAXINFER_AVX512)
INLINE __m512 x86(F v) { return reinterpret_cast<__m512&>(v); }
INLINE F ext(__m512 v) { return reinterpret_cast<F&>(v); }
INLINE F fma(F a, F b, F c) { return ext(_mm512_fmadd_ps(x86(a), x86(b), x86(c))); }
INLINE float hsum(F v) { return _mm512_reduce_add_ps(x86(v)); }
INLINE float hmax(F v) { return _mm512_reduce_max_ps(x86(v)); }
INLINE F select(Mask m, F yes, F no) { return ext(_mm512_mask_mov_ps(x86(no), m, x86(yes))); }
INLINE F load_n(const float* p, Mask m) { return ext(_mm512_maskz_loadu_ps(m, p)); }
INLINE void store_n(float* p, Mask m, F v) { _mm512_mask_storeu_ps(p, m, x86(v)); }
INLINE Int s8x16_n(const int8_t* p, Mask m) {
  __m512i v = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p));
  return reinterpret_cast<Int&>(v);
}
INLINE UInt u16x16_n(const uint16_t* p, Mask m) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return reinterpret_cast<UInt&>(v);
}
INLINE F halves(const uint16_t* p) {
  return ext(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
INLINE F halves_n(const uint16_t* p, Mask m) {
  return ext(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)));
}
INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }
INLINE uint16_t f2h(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// table[idx & 15] per lane (vpermps reads only the low 4 bits).
INLINE F lookup(Int idx, F table) {
  return ext(_mm512_permutexvar_ps(reinterpret_cast<__m512i&>(idx), x86(table)));
}
INLINE Mask test_bytes(const uint8_t* p, uint8_t bit) {
  return _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                            _mm_set1_epi8(char(bit)));
}
// *p broadcast to 16 lanes by a load, not a shuffle: written as asm because gcc forwards a
// just-stored float through shuffles (extract, then broadcast from a register), and shuffles
// (vpermps, vpmovzxbd) are what the 4-bit formats are short of.
INLINE F bcast(const float* p) {
  __m512 r;
  asm("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
  return ext(r);
}
INLINE F round(F v) {
  return ext(_mm512_roundscale_ps(x86(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
INLINE F scale2(F v, F n) { return ext(_mm512_scalef_ps(x86(v), x86(n))); }  // v 2^n
#else
// The generic bodies (on Lanes), split where an instruction set has a faster one.
INLINE F fma(F a, F b, F c) {
#if defined(JAXINFER_AVX2)
  return each<F>([](auto x, auto y, auto z) UNROLLED {
    return F::N(_mm256_fmadd_ps(__m256(x), __m256(y), __m256(z)));
  }, a, b, c);
#elif defined(JAXINFER_NEON)
  return each<F>([](auto x, auto y, auto z) UNROLLED {
    return F::N(vfmaq_f32(float32x4_t(z), float32x4_t(x), float32x4_t(y)));
  }, a, b, c);
#else  // two roundings: an FMA without the instruction is a library call per lane
  return a * b + c;
#endif
}
// Lanes l and l + 8 first, then l + 4, l + 2, l + 1: the order of AVX-512's reduction.
template <class T, class Op>
INLINE T reduce(const Lanes<T>& v, Op op) {
  typedef T N8 __attribute__((vector_size(8 * sizeof(T))));
  typedef T N4 __attribute__((vector_size(4 * sizeof(T))));
  N8 a;
  if constexpr (Lanes<T>::kPer == 8) {
    a = op(v.p[0], v.p[1]);
  } else {
    const auto lo = op(v.p[0], v.p[2]), hi = op(v.p[1], v.p[3]);
    std::memcpy(&a, &lo, sizeof(lo)), std::memcpy(reinterpret_cast<char*>(&a) + sizeof(lo), &hi, sizeof(hi));
  }
  const N4 b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  return op(op(b[0], b[2]), op(b[1], b[3]));
}
INLINE float hsum(F v) {
  return reduce(v, [](auto x, auto y) UNROLLED { return x + y; });
}
INLINE float hmax(F v) {
  return reduce(v, [](auto x, auto y) UNROLLED { return x > y ? x : y; });
}
INLINE F select(Mask m, F yes, F no) { return where(expand(m), yes, no); }
INLINE F load_n(const float* p, Mask m) {
  if (m == 0xFFFF) return load(p);
  F r = F{};
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) r.set(l, p[l]);
  return r;
}
INLINE void store_n(float* p, Mask m, F v) {
  if (m == 0xFFFF) return store(p, v);
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) p[l] = v[l];
}
INLINE Int s8x16_n(const int8_t* p, Mask m) {
  Int r = Int{};
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) r.set(l, p[l]);
  return r;
}
INLINE UInt u16x16_n(const uint16_t* p, Mask m) {
  UInt r = UInt{};
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) r.set(l, p[l]);
  return r;
}
#if defined(JAXINFER_AVX2)
INLINE float h2f(uint16_t h) { return _cvtsh_ss(h); }
INLINE uint16_t f2h(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE F halves(const uint16_t* p) {
  F r;
  static_for<2>([&](auto k) UNROLLED {
    r.p[k] = F::N(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * k))));
  });
  return r;
}
#elif defined(JAXINFER_NEON)
INLINE float h2f(uint16_t h) {
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return float(f);
}
INLINE uint16_t f2h(float x) {
  const __fp16 f = __fp16(x);  // round to nearest even
  uint16_t h;
  std::memcpy(&h, &f, 2);
  return h;
}
INLINE F halves(const uint16_t* p) {
  F r;
  static_for<4>([&](auto k) UNROLLED {
    r.p[k] = F::N(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * k))));
  });
  return r;
}
#else
INLINE float h2f(uint16_t h) { return h2f_soft(h); }
INLINE uint16_t f2h(float x) { return f2h_soft(x); }
INLINE F halves(const uint16_t* p) {
  F r;
  for (int l = 0; l < 16; ++l) r.set(l, h2f_soft(p[l]));
  return r;
}
#endif
INLINE F halves_n(const uint16_t* p, Mask m) {
  uint16_t h[16] = {};
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) h[l] = p[l];
  return halves(h);
}
// table[idx & 15] per lane.
INLINE F lookup(Int idx, F table) {
#if defined(JAXINFER_AVX2)  // two 8-entry permutes per half, then a blend on bit 3
  return each<F>([&](auto ix) UNROLLED {
    const __m256i i = __m256i(ix);
    const __m256 lo = _mm256_permutevar8x32_ps(__m256(table.p[0]), i);
    const __m256 hi = _mm256_permutevar8x32_ps(__m256(table.p[1]), i);
    return F::N(_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28))));
  }, idx);
#else
  F r;
  for (int l = 0; l < 16; ++l) r.set(l, table[idx[l] & 15]);
  return r;
#endif
}
INLINE Mask test_bytes(const uint8_t* p, uint8_t bit) {
#if defined(__SSE2__)  // every x86-64 build: one compare and movemask
  const __m128i b = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                  _mm_set1_epi8(char(bit)));
  return Mask(_mm_movemask_epi8(_mm_cmpeq_epi8(b, _mm_setzero_si128()))) ^ 0xFFFF;
#else
  const B16 b = load_as<B16>(p);
  const auto set = (b & bit) != 0;  // bytes of all ones or zeros
  Mask m = 0;
  for (int l = 0; l < 16; ++l) m |= Mask(set[l] & 1) << l;
  return m;
#endif
}
INLINE F bcast(const float* p) { return set1(*p); }
// Round to nearest even for |v| < 2^22 (the exp's argument is clamped far inside that).
INLINE F round(F v) { return (v + 12582912.0f) - 12582912.0f; }
// v 2^n for integral n in [-252, 128): two exact power-of-two factors.
INLINE F scale2(F v, F n) {
  const Int ni = to_int(n), a = ni >> 1, b = ni - a;
  return v * bits_float((a + 127) << 23) * bits_float((b + 127) << 23);
}
#endif

// table[idx & 15] where high is clear, hi[idx & 15] where it is set: 32 levels.
INLINE F lookup32(Int idx, Mask high, F lo, F hi) {
#if defined(JAXINFER_AVX512)
  return ext(_mm512_mask_permutexvar_ps(x86(lookup(idx, lo)), high,
                                        reinterpret_cast<__m512i&>(idx), x86(hi)));
#else
  return select(high, lookup(idx, hi), lookup(idx, lo));
#endif
}

// The 16 horizontal sums of v[0..15] in one vector, lane 4 m + r holding the sum of
// v[slot(r, m)]: a transpose-and-add tree of 45 shuffles and adds, where 16 separate
// reductions take about 130. Indices are compile-time constants throughout (static_for), so
// that gcc keeps the arrays in registers.
INLINE constexpr int swap12(int i) { return i == 1 ? 2 : i == 2 ? 1 : i; }
INLINE constexpr int slot(int r, int m) { return swap12(r) + 4 * swap12(m); }
INLINE F sums16(const F (&v)[16]) {
#if defined(JAXINFER_AVX512)
  __m512 w[8], z[4], p[2];
  static_for<8>([&](auto k) {  // 128-bit lanes 0, 1: v[k]; 2, 3: v[k + 8]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x86(v[k]), x86(v[k + 8]), 0x44),
                         _mm512_shuffle_f32x4(x86(v[k]), x86(v[k + 8]), 0xEE));
  });
  static_for<4>([&](auto k) {  // lanes: v[k], v[k + 8], v[k + 4], v[k + 12]
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[k], w[k + 4], 0x88),
                         _mm512_shuffle_f32x4(w[k], w[k + 4], 0xDD));
  });
  static_for<2>([&](auto k) {  // within a lane: z[k], z[k + 2], z[k], z[k + 2]
    p[k] = _mm512_add_ps(_mm512_unpacklo_ps(z[k], z[k + 2]), _mm512_unpackhi_ps(z[k], z[k + 2]));
  });
  // within a lane: z[0], z[2], z[1], z[3]
  return ext(_mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x44), _mm512_shuffle_ps(p[0], p[1], 0xEE)));
#else
  F r;
  static_for<4>([&](auto m) UNROLLED {
    static_for<4>([&](auto q) UNROLLED { r.set(4 * m + q, hsum(v[slot(q, m)])); });
  });
  return r;
#endif
}

// e^x in 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact n ln2),
// e^r by Cephes' expf polynomial (relative error ~1e-7), scaled by 2^n. Inputs below -104
// give 0 (or a subnormal), as exp does in float32.
INLINE F exp16(F x) {
  x = where(x < -104.0f, set1(-104.0f), x);
  x = where(x > 88.7f, set1(88.7f), x);
  const F n = round(x * 1.44269504088896341f);
  F r = fma(-n, set1(0.693359375f), x);
  r = fma(-n, set1(-2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p * r, r, r + 1.0f);
  return scale2(p, n);
}


// ---- 8-bit integer products (qmatmul's int8 activations) ----
// 32 int8 (or uint8) lanes, and 8 int32 lanes. Plain gcc vectors on every build: one ymm with
// AVX2 or AVX-512; without AVX gcc splits each operation into two 128-bit halves.
typedef int8_t S8 __attribute__((vector_size(32), aligned(1)));
typedef int32_t I8 __attribute__((vector_size(32), aligned(4)));  // 8 int32 lanes

INLINE S8 load32(const int8_t* p) { return load_as<S8>(p); }
INLINE B32 load32(const uint8_t* p) { return load_as<B32>(p); }
// 16 bytes of nibbles as 32 values: lanes [0, 16) the low nibbles, [16, 32) the high ones.
INLINE B32 nibbles(const uint8_t* p) {
  const B16 b = load_as<B16>(p);
  const B16 lo = b & 15, hi = b >> 4;
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}
// Lane j: 16 where bit j of `bits` is set, else 0 (the fifth bits of Q5_0 / Q5_1).
INLINE B32 bit_bytes(uint32_t bits) {
#if defined(JAXINFER_AVX512) || defined(JAXINFER_AVX2)
  // byte j / 8 of bits into lane j, then lane j's own bit tested
  const __m256i v = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return B32(_mm256_and_si256(set, _mm256_set1_epi8(16)));
#else
  B32 r;
  for (int j = 0; j < 32; ++j) r[j] = uint8_t((bits >> j & 1) << 4);
  return r;
#endif
}
// Lane k: the sum of w[i] x[i] over i in [4k, 4k + 4), times s_lo for k < 4 (lanes [0, 16)),
// s_hi for k >= 4. Exact in int32 for |w| <= 128, |x| <= 127, |s| <= 127 (x86's pairs of
// products are int16: 2 * 128 * 127 fits).
INLINE I8 dot(S8 w, S8 x, int16_t s_lo = 1, int16_t s_hi = 1) {
#if defined(JAXINFER_AVX512) || defined(JAXINFER_AVX2)
  const __m256i wi = __m256i(w), xi = __m256i(x);
  // |w| times x with w's sign: maddubs takes one unsigned operand
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wi, wi), _mm256_sign_epi8(xi, wi));
  return I8(_mm256_madd_epi16(p, _mm256_setr_m128i(_mm_set1_epi16(s_lo), _mm_set1_epi16(s_hi))));
#elif defined(JAXINFER_NEON)
  int8x16_t wp[2], xp[2];
  std::memcpy(wp, &w, 32), std::memcpy(xp, &x, 32);
  int32x4_t r[2];
  for (int h = 0; h < 2; ++h) {
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(wp[h]), vget_low_s8(xp[h])));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(wp[h], xp[h]));
    r[h] = vmulq_n_s32(vpaddq_s32(lo, hi), h ? s_hi : s_lo);
  }
  I8 out;
  std::memcpy(&out, r, 32);
  return out;
#else
  I8 r;
  for (int k = 0; k < 8; ++k) {
    int32_t sum = 0;
    for (int i = 4 * k; i < 4 * k + 4; ++i) sum += int32_t(w[i]) * int32_t(x[i]);
    r[k] = sum * (k < 4 ? s_lo : s_hi);
  }
  return r;
#endif
}
// dot() for unsigned weights w <= 127 (the K-quants' q before any offset): x86 multiplies
// them as maddubs's unsigned operand, without dot()'s two sign operations.
INLINE I8 udot(B32 w, S8 x, int16_t s_lo = 1, int16_t s_hi = 1) {
#if defined(JAXINFER_AVX512) || defined(JAXINFER_AVX2)
  const __m256i p = _mm256_maddubs_epi16(__m256i(w), __m256i(x));
  return I8(_mm256_madd_epi16(p, _mm256_setr_m128i(_mm_set1_epi16(s_lo), _mm_set1_epi16(s_hi))));
#else
  return dot(S8(w), x, s_lo, s_hi);
#endif
}
INLINE F8 to_float(I8 v) { return __builtin_convertvector(v, F8); }
INLINE F8 set8(float x) { return F8{x, x, x, x, x, x, x, x}; }  // a splat (F8{} + x adds a zero)
INLINE F8 fma(F8 a, F8 b, F8 c) {
#if defined(JAXINFER_AVX512) || defined(JAXINFER_AVX2)
  return F8(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}
// Lanes l and l + 4 first, then l + 2, l + 1 (AVX2's usual reduction).
INLINE float hsum(F8 v) {
  typedef float F4 __attribute__((vector_size(16)));
  const F4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// ---- 8-bit products in 16 int32 lanes (qmatmul's GEMM, gemm.h) ----
// A panel holds 16 activation rows, 4 bytes of each per 64-byte group (lane l: row l's values
// [4g, 4g + 4)); the weight's 4 bytes at the same columns are one int32 broadcast to all
// lanes. dp4: lane l + sum_k x[4 l + k] w[k]. With VNNI the panel holds x + 128 as unsigned
// bytes (vpdpbusd multiplies unsigned by signed; the caller starts each sum at -128 sum(w)),
// else x itself, multiplied as |x| times w with x's sign (maddubs's operands: 2 * 127 * 128
// fits its int16 pairs), or widened (NEON, scalar).
#if defined(JAXINFER_VNNI)
constexpr bool kBiasedX = true;  // panels hold x + 128
#else
constexpr bool kBiasedX = false;
#endif
struct X8 {  // one panel group, as dp4 wants it
#if defined(JAXINFER_AVX512)
  __m512i x, ax;  // ax: |x| (without VNNI)
  __mmask64 neg;  // x < 0
#elif defined(JAXINFER_AVX2)
  __m256i x[2], ax[2];
#else
  int8_t x[64];
#endif
};
INLINE X8 x8(const uint8_t* p) {
  X8 r;
#if defined(JAXINFER_VNNI)
  r.x = _mm512_loadu_si512(p);
#elif defined(JAXINFER_AVX512)
  r.x = _mm512_loadu_si512(p);
  r.ax = _mm512_abs_epi8(r.x);
  r.neg = _mm512_movepi8_mask(r.x);
#elif defined(JAXINFER_AVX2)
  static_for<2>([&](auto h) UNROLLED {
    r.x[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    r.ax[h] = _mm256_abs_epi8(r.x[h]);
  });
#else
  std::memcpy(r.x, p, 64);
#endif
  return r;
}
// kFull: w may hold -128 (Q8_0's bytes), whose sign cannot be moved onto it; then |w| is
// the unsigned operand and x takes w's sign (x never holds -128: llama.cpp's activations lie
// in [-127, 127]).
template <bool kFull = false>
INLINE Int dp4(Int acc, const X8& x, int32_t w) {
#if defined(JAXINFER_VNNI)
  __m512i a = reinterpret_cast<__m512i&>(acc);
  a = _mm512_dpbusd_epi32(a, x.x, _mm512_set1_epi32(w));
  return reinterpret_cast<Int&>(a);
#elif defined(JAXINFER_AVX512)
  const __m512i wb = _mm512_set1_epi32(w), zero = _mm512_setzero_si512();
  __m512i u, sv;
  if constexpr (kFull) {
    u = _mm512_abs_epi8(wb), sv = _mm512_mask_sub_epi8(x.x, _mm512_movepi8_mask(wb), zero, x.x);
  } else {
    u = x.ax, sv = _mm512_mask_sub_epi8(wb, x.neg, zero, wb);  // w sign(x)
  }
  const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u, sv), _mm512_set1_epi16(1));
  __m512i a = _mm512_add_epi32(reinterpret_cast<__m512i&>(acc), p);
  return reinterpret_cast<Int&>(a);
#elif defined(JAXINFER_AVX2)
  const __m256i wb = _mm256_set1_epi32(w);
  Int r;
  static_for<2>([&](auto h) UNROLLED {
    __m256i u, sv;
    if constexpr (kFull)
      u = _mm256_abs_epi8(wb), sv = _mm256_sign_epi8(x.x[h], wb);  // x sign(w)
    else
      u = x.ax[h], sv = _mm256_sign_epi8(wb, x.x[h]);  // w sign(x)
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, sv), _mm256_set1_epi16(1));
    r.p[h] = Int::N(_mm256_add_epi32(__m256i(acc.p[h]), p));
  });
  return r;
#elif defined(JAXINFER_NEON)
  const int8x8_t wb = vreinterpret_s8_s32(vdup_n_s32(w));
  Int r;
  static_for<4>([&](auto q) UNROLLED {  // lanes 4q..4q+3: 16 bytes of x
    const int8x16_t xv = vld1q_s8(x.x + 16 * q);
    const int16x8_t lo = vmull_s8(vget_low_s8(xv), wb), hi = vmull_s8(vget_high_s8(xv), wb);
    const int32x4_t sums = vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
    r.p[q] = Int::N(vaddq_s32(int32x4_t(acc.p[q]), sums));
  });
  return r;
#else
  int8_t wk[4];
  std::memcpy(wk, &w, 4);
  Int r = acc;
  for (int l = 0; l < 16; ++l) {
    int32_t sum = 0;
    for (int k = 0; k < 4; ++k) sum += int32_t(x.x[4 * l + k]) * wk[k];
    r.set(l, r[l] + sum);
  }
  return r;
#endif
}

// With AVX2, a K-quant block's sum stays in int32 (gemm.h's integer scales) with the scale
// taken by the widening of int16 sums: dp4w adds a group's products to per-lane int16 pairs
// (vpmaddubsw, vpaddw), widen adds s times those pairs to int32 lanes (vpmaddwd by s where dp4
// multiplies by 1). kUnsigned: w's bytes lie in [0, 31] (Q4_K, Q5_K), the unsigned operand
// of vpmaddubsw as they are, x the signed one, without dp4's sign moves. An int16 pair takes
// at most 32767 / (2 * 127 * max|w|) groups (4 for |w| <= 32, 8 for Q4_K's <= 15: the
// caller's spans); a block's 64 groups times |s| <= 128 stay far inside int32.
#if defined(JAXINFER_AVX2)
constexpr bool kWordSums = true;
template <bool kUnsigned>
INLINE Int dp4w(Int acc, const X8& x, int32_t w) {
  const __m256i wb = _mm256_set1_epi32(w);
  Int r;
  static_for<2>([&](auto h) UNROLLED {
    const __m256i p = kUnsigned ? _mm256_maddubs_epi16(wb, x.x[h])
                                : _mm256_maddubs_epi16(x.ax[h], _mm256_sign_epi8(wb, x.x[h]));
    r.p[h] = Int::N(_mm256_add_epi16(__m256i(acc.p[h]), p));
    asm("" : "+x"(r.p[h]));  // one chain per sum: gcc's tree of adds spilled the products
  });
  return r;
}
INLINE Int widen(Int acc, Int pairs, int32_t s) {
  const __m256i sv = _mm256_set1_epi16(int16_t(s));
  Int r;
  static_for<2>([&](auto h) UNROLLED {
    r.p[h] = Int::N(_mm256_add_epi32(__m256i(acc.p[h]), _mm256_madd_epi16(__m256i(pairs.p[h]), sv)));
  });
  return r;
}
#else
constexpr bool kWordSums = false;
template <bool kUnsigned>
Int dp4w(Int acc, const X8& x, int32_t w);  // AVX2's only (callers test kWordSums)
Int widen(Int acc, Int pairs, int32_t s);
#endif

// acc + a b over int16 pairs: lane l + a.lo b.lo + a.hi b.hi, a's lane l (two int16) against
// b's two int16 in every lane (vpdpwssd; the GEMM's K-quant min terms, two sub-blocks a step).
INLINE Int dp2(Int acc, Int a, int32_t b) {
#if defined(JAXINFER_VNNI)
  __m512i r = reinterpret_cast<__m512i&>(acc);
  r = _mm512_dpwssd_epi32(r, reinterpret_cast<__m512i&>(a), _mm512_set1_epi32(b));
  return reinterpret_cast<Int&>(r);
#elif defined(JAXINFER_AVX512)
  const __m512i p = _mm512_madd_epi16(reinterpret_cast<__m512i&>(a), _mm512_set1_epi32(b));
  __m512i r = _mm512_add_epi32(reinterpret_cast<__m512i&>(acc), p);
  return reinterpret_cast<Int&>(r);
#elif defined(JAXINFER_AVX2)
  const __m256i bv = _mm256_set1_epi32(b);
  Int r;
  static_for<2>([&](auto h) UNROLLED {
    r.p[h] = Int::N(_mm256_add_epi32(__m256i(acc.p[h]), _mm256_madd_epi16(__m256i(a.p[h]), bv)));
  });
  return r;
#else
  const int32_t lo = int16_t(b & 0xFFFF), hi = int16_t(uint32_t(b) >> 16);
  return acc + ((a << 16) >> 16) * lo + (a >> 16) * hi;
#endif
}

}  // namespace vec
}  // namespace jaxinfer
