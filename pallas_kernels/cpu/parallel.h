// Work spread over XLA's own intra-op thread pool, from inside an FFI call.
//
// Why not OpenMP: XLA:CPU calls a kernel from whichever of its threads runs the step, and
// libgomp keeps one team of threads per calling thread, each spinning after its region. On a
// 2-core machine that put up to four busy threads on two cores beside XLA's own: a 576 x 576
// int8 matmul took 150-600 us through OpenMP where its work is 20 us. Here the caller and the
// pool's other threads take pieces from one atomic counter; whoever starts late finds none
// left. The pieces, and each piece's arithmetic, do not depend on who runs them, so results
// do not depend on the number of threads or on timing.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

// body(begin, end) over [0, n) in pieces of at most `grain`, on the calling thread and up to
// pool.num_threads() - 1 helpers; returns when every piece is done.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t pieces = (n + grain - 1) / grain;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), pieces) - 1;
  if (helpers <= 0) {
    body(0, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  // A helper that starts after the last piece was taken touches only `state` (kept alive by
  // its own reference): `body` is used only by whoever takes a piece, before `done` counts it.
  auto work = [state, n, grain, pieces, b = &body] {
    for (int64_t p; (p = state->next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      (*b)(p * grain, std::min(n, (p + 1) * grain));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  while (state->done.load(std::memory_order_acquire) < pieces) std::this_thread::yield();
}

// Pieces for n items: about four per thread, so a thread that starts late still gets work.
inline int64_t Grain(xla::ffi::ThreadPool& pool, int64_t n) {
  return std::max<int64_t>(1, n / (4 * std::max<int64_t>(1, pool.num_threads())));
}

}  // namespace jaxllm
