// The kernels' compute routines on fixed pseudo-random inputs, for comparing two builds of
// one source (tests/test_kernel_variants.py: the NEON variant against the scalar one, both
// run under qemu-aarch64). Writes float32 values to two files: argv[1] the values that must
// be bit-equal (every format's dequantized weights), argv[2] the sums that may differ by
// rounding (the products at several activation row counts, with float and 8-bit activations,
// then attention outputs; the q8_0 pools' bytes the kernel's writes quantized go with the
// exact values).
#include <cstdio>
#include <vector>

#include "attend.cc"
#include "q_float.cc"
#include "q_kquants.cc"
#include "q_legacy.cc"

namespace {

uint64_t state = 88172645463325252ull;
uint32_t next() {  // xorshift64
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return uint32_t(state >> 11);
}
float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() % 1000000) / 1e6f; }

FILE *exact_out, *sums_out;
void emit(FILE* to, const float* v, size_t n) { std::fwrite(v, sizeof(float), n, to); }

size_t bytes(ffi::DataType t) {
  return t == DataType::F32 ? 4 : (t == DataType::F16 || t == DataType::BF16) ? 2 : 1;
}

// Random parts of an O x I weight of format Fmt: bytes for the quantized parts, scales of
// +-0.1 (f16), floats of +-1 (f32, bf16).
template <class Fmt>
void check_format(int64_t O, int64_t I) {
  using S = Spec<Fmt>;
  constexpr size_t P = std::size(S::kTypes);
  std::vector<std::vector<uint8_t>> parts(P);
  const void* p[P];
  for (size_t k = 0; k < P; ++k) {
    const int64_t n = S::kPer[k] ? O * (I / S::kPer[k]) : O;
    parts[k].resize(n * bytes(S::kTypes[k]));
    for (int64_t i = 0; i < n; ++i) {
      uint8_t* at = parts[k].data() + i * bytes(S::kTypes[k]);
      if (S::kTypes[k] == DataType::F32) {
        const float f = uniform(-1, 1);
        std::memcpy(at, &f, 4);
      } else if (S::kTypes[k] == DataType::F16) {
        const uint16_t h = jaxinfer::vec::f2h_soft(uniform(-0.1f, 0.1f));
        std::memcpy(at, &h, 2);
      } else if (S::kTypes[k] == DataType::BF16) {
        const float f = uniform(-1, 1);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        const uint16_t h = uint16_t(u >> 16);
        std::memcpy(at, &h, 2);
      } else {
        *at = uint8_t(next());
      }
    }
    p[k] = parts[k].data();
  }
  const Fmt f = S::make(p, I);
  std::vector<float> w(O * I);
  for (int64_t o = 0; o < O; ++o) dequantize<Fmt, 1>(f, &o, I, w.data() + o * I);
  emit(exact_out, w.data(), w.size());
  for (int64_t M : {1, 2, 5, 8, 13}) {
    std::vector<float> x(M * I), y(M * O), sums(I / 32 + 1);
    for (float& v : x) v = uniform(-1, 1);
    for (int64_t j = 0; j < I / 32; ++j)
      for (int i = 0; i < 32; ++i) sums[j] += x[32 * j + i];
    rows(f, x.data(), M, I, O, 0, O, y.data(), sums.data());
    emit(sums_out, y.data(), y.size());
  }
  if constexpr (HasIdot<Fmt>::value)  // 8-bit activations' integer products
    for (int64_t M : {1, 3, 6}) {
      std::vector<float> x(M * I), y(M * O);
      for (float& v : x) v = uniform(-1, 1);
      const int64_t blocks = I / 32;  // the rows quantized as quantize_all() does, serially
      std::vector<int8_t> q(M * I);
      std::vector<float> d(M * blocks), s(M * blocks);
      std::vector<Acts> acts(M);
      for (int64_t m = 0; m < M; ++m)
        acts[m] = quantize(Fmt::kActs, x.data() + m * I, I, q.data() + m * I,
                           d.data() + m * blocks, s.data() + m * blocks);
      int_rows(f, acts.data(), M, O, 0, O, y.data());
      emit(sums_out, y.data(), y.size());
    }
}

// 4 pages of one kv head [4, rows, S], random values in [-1, 1) written as the kernel writes
// a token's (rounded to a 16-bit pool's type, quantized into a q8_0 pool), 16 positions at a
// time; the q8_0 pools' bytes go to the exact output.
template <class Pool>
std::vector<typename Pool::T> random_pool(int64_t H, int64_t S) {
  const int64_t R = Pool::rows(H);
  std::vector<typename Pool::T> pool(4 * R * S);
  std::vector<float> x(16 * H);
  for (int64_t page = 0; page < 4; ++page)
    for (int64_t c = 0; c < S; c += 16) {
      for (float& v : x) v = uniform(-1, 1);
      columns<Pool>(x.data(), H, pool.data() + page * R * S, c, 16, H, S);
    }
  if constexpr (Pool::kScaled) {
    std::vector<float> bytes(pool.begin(), pool.end());
    emit(exact_out, bytes.data(), bytes.size());
  }
  return pool;
}

template <class KPool, class VPool>
void check_attention(int64_t G, int64_t H, int64_t S, int64_t n) {
  const Shape d{1, 1, 1, G, H, 4, S, 4, 0};
  const std::vector<typename KPool::T> k = random_pool<KPool>(H, S);
  const std::vector<typename VPool::T> v = random_pool<VPool>(H, S);
  std::vector<float> q(G * H), out(G * H);
  for (float& x : q) x = uniform(-1, 1);
  const int32_t table[4] = {2, 0, 3, 1};
  Queries qs;
  qs.Q = G, qs.token = G * H, qs.q = q.data(), qs.out = out.data();
  for (int64_t i = 0; i < G; ++i) qs.lo[i] = 0, qs.n[i] = n;
  std::vector<float> work(17 * 4 * H + 256 + 2 * 4 * S);
  head<KPool, VPool, 4>(d, qs, k.data(), v.data(), table, work.data());
  emit(sums_out, out.data(), out.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  exact_out = std::fopen(argv[1], "wb"), sums_out = std::fopen(argv[2], "wb");
  check_format<Q8_0>(37, 96);
  check_format<Q4<false>>(37, 96);
  check_format<Q4<true>>(37, 96);
  check_format<Q5<false>>(37, 96);
  check_format<Q5<true>>(37, 96);
  check_format<Q4_K>(19, 512);
  check_format<Q5_K>(19, 512);
  check_format<Q6_K>(19, 512);
  check_format<Int8>(37, 100);
  check_format<Half<false>>(37, 100);
  check_format<Half<true>>(37, 100);
  check_format<Full>(37, 100);
  check_attention<F32Pool, F32Pool>(4, 16, 32, 100);
  check_attention<F16Pool, F16Pool>(4, 16, 32, 77);
  check_attention<BF16Pool, BF16Pool>(4, 16, 32, 53);
  check_attention<Q8Pool, Q8Pool>(4, 64, 32, 90);
  check_attention<Q8Pool, F16Pool>(4, 16, 32, 70);
  check_attention<F32Pool, Q8Pool>(4, 8, 32, 61);
  return std::fclose(exact_out) || std::fclose(sums_out);
}
