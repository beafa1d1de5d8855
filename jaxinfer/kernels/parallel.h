// Shared by the CPU kernels: a loop split over XLA's intra-op thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#define INLINE inline __attribute__((always_inline))

namespace jaxinfer {

// Chunks of [0, n) claimed from an atomic counter by the calling thread and the pool's tasks.
// A task that starts after every chunk is claimed returns at once, so the caller never waits
// for a task that has not started (no deadlock when the pool is busy, or is the caller's
// own), and the state a late task touches is kept alive by its shared_ptr.
struct Job {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0, n = 0;
  const void* ctx = nullptr;
  void (*fn)(const void*, int64_t, int64_t) = nullptr;

  int64_t bound(int64_t c) const { return c * n / chunks; }
  void drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      fn(ctx, bound(c), bound(c + 1));
      done.fetch_add(1, std::memory_order_release);
    }
  }
  void wait() const {
    for (int spins = 0; done.load(std::memory_order_acquire) < chunks; ++spins)
      if (spins < 256)
        _mm_pause();
      else
        std::this_thread::yield();
  }
};

constexpr int64_t kChunksPerThread = 4;  // a late task then still finds work

// fn(lo, hi) over [0, n) in chunks of at least `min_chunk` items, on XLA's intra-op pool: the
// caller plus num_threads - 1 tasks, so that no more threads run than the pool has (the
// caller is one of them or waits on them). With num_threads tasks (3 threads on 2 cores) a
// 24-matvec q8_0 chain took 2.7-3.5 ms, with num_threads - 1 1.7-1.8 ms, on the caller alone
// 3.2 ms; a std::thread pool of our own (spinning 50 us between calls) 1.8-2.3 ms.
template <class Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, const Fn& fn) {
  int64_t tasks = pool.num_threads() - 1;
  int64_t chunks = std::min((tasks + 1) * kChunksPerThread, n / std::max<int64_t>(1, min_chunk));
  if (tasks <= 0 || chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->chunks = chunks;
  job->n = n;
  job->ctx = &fn;
  job->fn = [](const void* ctx, int64_t lo, int64_t hi) { (*static_cast<const Fn*>(ctx))(lo, hi); };
  for (int64_t t = 0; t < std::min(tasks, chunks - 1); ++t) pool.Schedule([job] { job->drain(); });
  job->drain();
  job->wait();
}

}  // namespace jaxinfer
