// Shared by the CPU kernels: a loop split over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <chrono>
#include <mutex>

#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// A spin-wait's pause (a hint to the core; nothing where the target has none).
INLINE void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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
        pause();
      else
        std::this_thread::yield();
  }
};

constexpr int64_t kChunksPerThread = 4;  // a late task then still finds work

// A pool task that finished a job stays for the next one for up to kKeepMicros: a decode step
// calls the kernels every 10-150 us, and a woken pool thread takes longer than that to start
// (benchmarks/results/qkernel.md, "Moved from the code"). Jobs are posted here; a staying task
// picks them up without a pool hand-off.
constexpr int64_t kKeepMicros = 200;

struct Board {
  std::mutex lock;
  std::shared_ptr<Job> job;         // the newest posted job
  std::atomic<uint64_t> posted{0};  // jobs posted so far
  std::atomic<int> staying{0};      // tasks waiting for a job
};

inline Board& board() {
  static Board b;
  return b;
}

// A pool task: drain the posted job, then stay for new ones until none comes for a while.
inline void stay(uint64_t seen) {
  Board& b = board();
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> g(b.lock);
      job = b.job;
    }
    if (job) job->drain();
    b.staying.fetch_add(1, std::memory_order_acq_rel);
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kKeepMicros);
    uint64_t now;
    for (int spins = 0; (now = b.posted.load(std::memory_order_acquire)) == seen; ++spins)
      if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      else pause();
    b.staying.fetch_sub(1, std::memory_order_acq_rel);
    if (now == seen) return;
    seen = now;
  }
}

// fn(lo, hi) over [0, n) in chunks of at least `min_chunk` items, on XLA's intra-op pool: the
// caller plus num_threads - 1 tasks (those staying from earlier calls first), so that no more
// threads run than the pool has (the caller is one of them or waits on them); more tasks, or
// tasks that return at once, measured slower (benchmarks/results/qkernel.md).
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
  Board& b = board();
  {
    std::lock_guard<std::mutex> g(b.lock);
    b.job = job;
  }
  const uint64_t seen = b.posted.fetch_add(1, std::memory_order_acq_rel) + 1;
  const int64_t more = std::min(tasks, chunks - 1) - b.staying.load(std::memory_order_acquire);
  for (int64_t t = 0; t < more; ++t) pool.Schedule([seen] { stay(seen); });
  job->drain();
  job->wait();
}

}  // namespace jaxinfer
