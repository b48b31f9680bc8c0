// Work split over threads for the decode-time kernels: `claimed_for`, on a pool of our own.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace hybridkv {

// Items of `item_bytes` each in one claim of `claimed_for`: about 32 KiB of weights, a multiple
// of `multiple` items (the kernels' 8-row steps).
inline int64_t claim_items(int64_t item_bytes, int64_t multiple = 8) {
  return std::max<int64_t>(multiple, (32768 / std::max<int64_t>(1, item_bytes)) / multiple * multiple);
}

namespace detail {

// Set while a thread runs chunks of a `Pool` job: a `claimed_for` inside one runs serially.
inline thread_local bool in_pool_job = false;

// The threads of `claimed_for`. ATen's parallel_for (OpenMP) ends each region at a barrier: its
// caller waits until every thread of the team has come and gone, so when another process holds a
// core and one of our threads is off it, each of a decode step's ~200 regions waits for the
// scheduler to run that thread again, even when the others did all the work. Here the caller
// returns as soon as every chunk is done: a worker that arrives late finds the job over and
// leaves without touching it. Each share's next chunk carries its job's tag (the top 24 bits), so
// a claim by a worker that read an earlier job fails at its compare-and-swap; a job's function
// and state are only read after a claim succeeded, while the caller still waits for that chunk.
// Workers spin for a while between jobs (a step's regions come microseconds apart), then sleep.
class Pool {
 public:
  static constexpr int64_t MAX_THREADS = 256;

  // Never destroyed: sleeping workers may still wait on it when the process exits.
  static Pool& get() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // run(c) for each chunk c in [0, chunks): thread i (the caller is thread 0) claims the chunks of
  // the i-th of `threads` even shares in order, then helps with the others' rest. Serially when
  // another caller has the pool.
  template <class F>
  void run(int64_t chunks, int64_t threads, const F& run_chunk) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      for (int64_t c = 0; c < chunks; ++c) run_chunk(c);
      return;
    }
    threads = std::min(threads, MAX_THREADS);
    while (static_cast<int64_t>(workers_) < threads - 1) std::thread(&Pool::work, this, workers_++).detach();
    const uint64_t job = ++jobs_, tag = job & TAG_MASK;
    ctx_.store(&run_chunk, std::memory_order_relaxed);
    fn_.store([](const void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); }, std::memory_order_relaxed);
    for (int64_t i = 0; i < threads; ++i) done_[i].n.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    for (int64_t i = 0; i < threads; ++i) {  // next before end: see `claim`
      shares_[i].next.store((tag << TAG_SHIFT) | static_cast<uint64_t>(chunks * i / threads));
      shares_[i].end.store(chunks * (i + 1) / threads);
    }
    threads_.store(threads);
    job_.store(job);  // publish
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    claim(0, tag, threads);
    for (;;) {
      int64_t done = 0;
      for (int64_t i = 0; i < threads; ++i) done += done_[i].n.load(std::memory_order_acquire);
      if (done == chunks) break;
      _mm_pause();
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr int TAG_SHIFT = 40;
  static constexpr uint64_t TAG_MASK = (uint64_t{1} << 24) - 1, INDEX_MASK = (uint64_t{1} << TAG_SHIFT) - 1;
  struct alignas(64) Share {
    std::atomic<uint64_t> next{0};
    std::atomic<int64_t> end{0};
  };
  struct alignas(64) Done {  // chunks a thread finished in the job: a line of its own, not shared
    std::atomic<int64_t> n{0};
  };

  // Claims and runs chunks of job `tag` as thread `self`, until none is left or the job is over.
  void claim(int64_t self, uint64_t tag, int64_t threads) {
    in_pool_job = true;
    for (int64_t k = 0; k < threads; ++k) {
      Share& s = shares_[(self + k) % threads];
      uint64_t v = s.next.load();
      for (;;) {
        if ((v >> TAG_SHIFT) != tag) {  // a later job's share: this one is over
          in_pool_job = false;
          return;
        }
        // A later job writes `next` before `end`: an `end` read here that is already the later
        // job's means `next` has changed, and the swap below fails.
        if (static_cast<int64_t>(v & INDEX_MASK) >= s.end.load()) break;
        if (!s.next.compare_exchange_weak(v, v + 1)) continue;
        try {
          fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), static_cast<int64_t>(v & INDEX_MASK));
        } catch (...) {
          std::lock_guard<std::mutex> lock(sleep_);
          if (!error_) error_ = std::current_exception();
        }
        done_[self].n.store(done_[self].n.load(std::memory_order_relaxed) + 1, std::memory_order_release);
        v = s.next.load();
      }
    }
    in_pool_job = false;
  }

  void work(int64_t index) {
    uint64_t seen = job_.load();
    for (;;) {
      uint64_t job = job_.load();
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
      for (int i = 1; job == seen; ++i) {
        _mm_pause();
        job = job_.load(std::memory_order_acquire);
        if (job == seen && i % 256 == 0 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return job_.load() != seen; });
          sleepers_.fetch_sub(1);
          job = job_.load();
        }
      }
      seen = job;
      const int64_t threads = threads_.load();
      if (index + 1 < threads) claim(index + 1, job & TAG_MASK, threads);
    }
  }

  static constexpr int SPIN_US = 200;
  std::mutex busy_;
  int64_t workers_ = 0;  // started, under busy_
  uint64_t jobs_ = 0;    // under busy_
  std::atomic<uint64_t> job_{0};
  std::atomic<int64_t> threads_{0};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<void (*)(const void*, int64_t)> fn_{nullptr};
  Done done_[MAX_THREADS];
  std::exception_ptr error_;  // the first exception of the job, under sleep_
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  Share shares_[MAX_THREADS];
};

}  // namespace detail

// f(n0, n1) over [0, N) in chunks of `chunk`: thread i claims the chunks of its own share (the
// i-th of `threads` even shares) in order, then helps with the others' rest, so that a thread slowed
// by another process or one that arrives late holds the others for one chunk at most, while each
// still reads its own share as one stream; the caller returns when every chunk is done, without
// waiting for a thread that found none (`detail::Pool`). Below `serial_below` items, one thread.
template <class F>
void claimed_for(int64_t N, int64_t chunk, const F& f, int64_t serial_below = 0) {
  const int64_t chunks = (N + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || N < serial_below || at::in_parallel_region() || detail::in_pool_job) {
    if (N > 0) f(0, N);
    return;
  }
  detail::Pool::get().run(chunks, threads, [&](int64_t c) { f(c * chunk, std::min(N, (c + 1) * chunk)); });
}

}  // namespace hybridkv
