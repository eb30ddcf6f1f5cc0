// kvdiag native allocators: a multi-threaded stress driver (used by the sanitizer builds and by
// benchmarks/allocator.py through kvdiag._native.stress).
//
// Contract of this file (pure C++, no Python):
//   Locks:   only the allocators' own; the driver's shared ownership table is lock-free atomics.
//   GIL:     never touched (the binding releases the GIL for the whole run).
//   Waits:   each op is timed; an op slower than stall_ms counts as a stall. Threads are joined at
//            the end; the run is bounded by `ops` (and by the fixed allocator's own bounds).
#pragma once

#include <cstdint>
#include <string>

#include "common.hpp"

namespace kvdiag {

struct StressOptions {
  std::string kind = "fixed";       // "fixed" | "stock"
  std::string mode = "random";      // "random" | "alloc_free" (fast-path ping-pong)
  int threads = 4;
  int64_t ops = 1000000;            // total over all threads
  uint64_t seed = 1;
  int64_t stall_ms = 100;
  int64_t hold_max = 8;             // pages one thread holds at most (random mode)
  bool start_prealloc = true;
  AllocatorConfig cfg;
};

struct StressResult {
  int64_t ops = 0;
  int64_t elapsed_ns = 0;
  int64_t max_op_ns = 0;
  int64_t stalls = 0;
  int64_t allocs = 0;
  int64_t frees = 0;
  int64_t out_of_pages = 0;   // "No free pages left" (expected under pressure)
  int64_t timeouts = 0;       // AllocatorTimeout
  int64_t errors = 0;         // any other exception
  int64_t double_allocs = 0;  // a page handed to two holders at once (must be 0)
  int64_t resizes_ok = 0;
  int64_t final_free = 0;
  int64_t final_total = 0;
  int64_t final_inflight = 0;
  std::string first_error;
  CounterSnapshot counters;  // the allocator's counters at the end of the run
};

StressResult run_stress(const StressOptions& opts);

}  // namespace kvdiag
