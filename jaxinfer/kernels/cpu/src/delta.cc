// XLA FFI CPU kernels of the Gated DeltaNet's delta rule (model/gdn.py), per value head:
//   S_t = e_t S_{t-1} + k_t (x) beta_t (v_t - e_t S_{t-1}^T k_t),  o_t = S_t^T q_t,
// e_t = exp(g_t), S [DK, DV] float32. XLA's form reads and writes the state several times per
// token (the decay, S^T k, the rank-1 update, S^T q: each a pass over DK x DV floats, 2 MiB per
// layer and request at Qwen3.5's 32 heads x 128 x 128). Here one pass reads S for both S^T k
// and S^T q (o_t = e_t S^T q + (k . q) delta), and a second one, over the head's state still
// in the cache, writes e_t S + k (x) delta: the state leaves memory once and returns once.
//
// delta_step: one token per row: q, k [B, H, DK], v [B, H, DV], g, beta [B, H], S [B, H, DK, DV]
// -> o [B, H, DV], S (in place: aliased). delta_chunk: T tokens per row ([B, T, H, ...]), token
// by token with the head's state held in a buffer, -> o [B, T, H, DV], S: the recurrence the
// float64 reference runs (gdn.chunked's WY form is XLA's way to get matmuls; a CPU core has no
// use for them at these sizes). Padding tokens carry beta = g = 0 and change nothing. Work
// split: the B x H (row, head) pairs over the threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer::parallel_for;
using namespace jaxinfer::vec;

// Values of DV handled per pass: the accumulators of S^T k and S^T q stay in registers for
// 4 x 16 of them (8 vectors); wider heads take several column blocks.
constexpr int64_t kBlockV = 64;

// One token of one head: s [DK, DV] (row stride DV) updated in place, o [DV] written.
void token(float* s, int64_t DK, int64_t DV, const float* q, const float* k, const float* v,
           float g, float beta, float* o) {
  const float e = std::exp(g);
  float kq = 0.0f;
  for (int64_t i = 0; i < DK; ++i) kq += k[i] * q[i];
  for (int64_t c0 = 0; c0 < DV; c0 += kBlockV) {
    const int64_t width = std::min(kBlockV, DV - c0);
    F sk[4], sq[4];
    for (int j = 0; j < 4; ++j) sk[j] = zero(), sq[j] = zero();
    Mask valid[4];  // the block's lanes in each of its 16-value vectors (0: past its end)
    for (int j = 0; j < 4; ++j) valid[j] = lanes(std::max<int64_t>(0, width - 16 * j));
    for (int64_t i = 0; i < DK; ++i) {  // the first pass: S^T k and S^T q
      const float* row = s + i * DV + c0;
      const F ki = set1(k[i]), qi = set1(q[i]);
      for (int j = 0; j < 4; ++j) {
        if (!valid[j]) break;
        const F x = load_n(row + 16 * j, valid[j]);
        sk[j] = fma(x, ki, sk[j]);
        sq[j] = fma(x, qi, sq[j]);
      }
    }
    F delta[4];
    for (int j = 0; j < 4; ++j) {
      if (!valid[j]) break;
      const F vv = load_n(v + c0 + 16 * j, valid[j]);
      delta[j] = (vv - sk[j] * e) * beta;  // beta (v - e S^T k)
      store_n(o + c0 + 16 * j, valid[j], fma(set1(kq), delta[j], sq[j] * e));
    }
    for (int64_t i = 0; i < DK; ++i) {  // the second pass: e S + k (x) delta
      float* row = s + i * DV + c0;
      const F ki = set1(k[i]);
      for (int j = 0; j < 4; ++j) {
        if (!valid[j]) break;
        store_n(row + 16 * j, valid[j], fma(ki, delta[j], load_n(row + 16 * j, valid[j]) * e));
      }
    }
  }
}

using F32 = ffi::Buffer<ffi::F32>;

// T tokens (T = 1: a step) of B rows and H heads. S [B, H, DK, DV], or stacked (depth-shared
// layers: [L, B, H, DK, DV], updated at `layer`).
ffi::Error run(ffi::ThreadPool pool, F32 q, F32 k, F32 v, F32 g, F32 beta, F32 state,
               ffi::Buffer<ffi::S32> layer, ffi::Result<F32> out, ffi::Result<F32> state_out,
               int64_t T) {
  auto sd = state.dimensions();
  const size_t lead = sd.size() == 5 ? 1 : 0;
  if (sd.size() != 4 + lead)
    return ffi::Error::InvalidArgument("delta: S must be [B, H, DK, DV] or [L, B, H, DK, DV]");
  const int64_t B = sd[lead], H = sd[lead + 1], DK = sd[lead + 2], DV = sd[lead + 3];
  const int64_t copies = lead ? sd[0] : 1, at = layer.typed_data()[0];
  if (at < 0 || at >= copies) return ffi::Error::InvalidArgument("delta: layer out of range");
  if (int64_t(q.element_count()) != B * T * H * DK || int64_t(k.element_count()) != B * T * H * DK ||
      int64_t(v.element_count()) != B * T * H * DV || int64_t(g.element_count()) != B * T * H ||
      int64_t(beta.element_count()) != B * T * H || int64_t(out->element_count()) != B * T * H * DV)
    return ffi::Error::InvalidArgument("delta: q, k, v, g, beta or o do not match S");
  float* s = state_out->typed_data();
  if (s != state.typed_data()) std::copy_n(state.typed_data(), state.element_count(), s);
  s += at * B * H * DK * DV;  // the layer's states within the stack
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *gp = g.typed_data(), *bp = beta.typed_data();
  float* op = out->typed_data();
  // (row, head) pairs; a chunk of at least 8 of them (a step's 2 x 16k-value passes apiece)
  parallel_for(pool, B * H, std::max<int64_t>(1, 8 / T), [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / H, h = task % H;
      float* sh = s + task * DK * DV;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (b * T + t) * H + h;  // the token's head in [B, T, H, ...]
        token(sh, DK, DV, qp + at * DK, kp + at * DK, vp + at * DV, gp[at], bp[at],
              op + at * DV);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error step(ffi::ThreadPool pool, F32 q, F32 k, F32 v, F32 g, F32 beta, F32 state,
                ffi::Buffer<ffi::S32> layer, ffi::Result<F32> out, ffi::Result<F32> state_out) {
  return run(pool, q, k, v, g, beta, state, layer, out, state_out, 1);
}

ffi::Error chunk(ffi::ThreadPool pool, F32 q, F32 k, F32 v, F32 g, F32 beta, F32 state,
                 ffi::Buffer<ffi::S32> layer, ffi::Result<F32> out, ffi::Result<F32> state_out) {
  auto gd = g.dimensions();
  if (gd.size() != 3) return ffi::Error::InvalidArgument("delta_chunk: g must be [B, T, H]");
  return run(pool, q, k, v, g, beta, state, layer, out, state_out, gd[1]);
}

auto bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<F32>()  // q
      .Arg<F32>()  // k
      .Arg<F32>()  // v
      .Arg<F32>()  // g
      .Arg<F32>()  // beta
      .Arg<F32>()  // S
      .Arg<ffi::Buffer<ffi::S32>>()  // layer (int32 []: 0 unless S is stacked)
      .Ret<F32>()  // o
      .Ret<F32>();  // S
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(delta_step, step, bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(delta_chunk, chunk, bind());
