// Work split over threads for the decode-time kernels: `claimed_for`.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace hybridkv {

// Items of `item_bytes` each in one claim of `claimed_for`: about 32 KiB of weights, a multiple
// of `multiple` items (the kernels' 8-row steps).
inline int64_t claim_items(int64_t item_bytes, int64_t multiple = 8) {
  return std::max<int64_t>(multiple, (32768 / std::max<int64_t>(1, item_bytes)) / multiple * multiple);
}

// f(n0, n1) over [0, N) in chunks of `chunk`: thread i claims the chunks of its own share (the
// i-th of `threads` even shares) in order, then helps with the others' rest, so that a thread slowed
// by another process or one that arrives late holds the others at the join for one chunk at most,
// while each still reads its own share as one stream. Below `serial_below` items, one thread.
template <class F>
void claimed_for(int64_t N, int64_t chunk, const F& f, int64_t serial_below = 0) {
  const int64_t chunks = (N + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || N < serial_below || at::in_parallel_region()) {
    if (N > 0) f(0, N);
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Share> shares(threads);
  for (int64_t i = 0; i < threads; ++i) {
    shares[i].next.store(chunks * i / threads, std::memory_order_relaxed);
    shares[i].end = chunks * (i + 1) / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t) {
    for (int64_t k = 0; k < threads; ++k) {
      Share& s = shares[(i0 + k) % threads];
      for (int64_t c = s.next.fetch_add(1, std::memory_order_relaxed); c < s.end;
           c = s.next.fetch_add(1, std::memory_order_relaxed))
        f(c * chunk, std::min(N, (c + 1) * chunk));
    }
  });
}

// Whether decode's weight streams are fetched ahead in software (the tiled K-quant products at up
// to 8 rows, the 32-weight types' at one row): hosts disagree on what is faster, so
// `ops.quant.stream.tune` measures it when a model loads and sets this (`kq_stream_ahead`).
inline std::atomic<bool>& stream_ahead_flag() {
  static std::atomic<bool> on{true};
  return on;
}

}  // namespace hybridkv
