// kvdiag native allocators: command-line stress driver for the sanitizer builds (no Python).
//
// Contract of this file (pure C++, no Python):
//   Locks:   none of its own (see stress.cpp and the allocators).
//   GIL:     there is no interpreter in this program.
//   Waits:   run_stress is bounded by its op budget; the fixed allocator bounds every wait.
// Usage: kvdiag_stress [kind=fixed] [threads=4] [ops=200000] [mode=random] [latency_us=0]
// Exits 1 when the run saw errors, double allocations, stalls or an inconsistent final state.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "stress.hpp"

int main(int argc, char** argv) {
  kvdiag::StressOptions o;
  o.kind = argc > 1 ? argv[1] : "fixed";
  o.threads = argc > 2 ? std::atoi(argv[2]) : 4;
  o.ops = argc > 3 ? std::atoll(argv[3]) : 200000;
  o.mode = argc > 4 ? argv[4] : "random";
  o.cfg.map_latency_us = argc > 5 ? std::atoll(argv[5]) : 0;
  o.cfg.num_layers = 4;
  o.cfg.page_size = 64 * 1024;
  o.cfg.mem_size_per_layer = 48 * o.cfg.page_size;
  o.cfg.min_reserved_pages = 4;
  o.cfg.max_reserved_pages = 8;
  o.cfg.device_name = "kvdiag-stress-" + std::to_string(getpid());
  o.stall_ms = 1000;
  o.hold_max = 6;
  kvdiag::StressResult r = kvdiag::run_stress(o);
  std::printf("kind=%s threads=%d ops=%lld elapsed_ms=%.1f allocs=%lld frees=%lld out_of_pages=%lld timeouts=%lld "
              "errors=%lld double_allocs=%lld stalls=%lld max_op_ms=%.2f final_free=%lld final_total=%lld "
              "final_inflight=%lld\n",
              o.kind.c_str(), o.threads, static_cast<long long>(r.ops), r.elapsed_ns / 1e6,
              static_cast<long long>(r.allocs), static_cast<long long>(r.frees), static_cast<long long>(r.out_of_pages),
              static_cast<long long>(r.timeouts), static_cast<long long>(r.errors),
              static_cast<long long>(r.double_allocs), static_cast<long long>(r.stalls), r.max_op_ns / 1e6,
              static_cast<long long>(r.final_free), static_cast<long long>(r.final_total),
              static_cast<long long>(r.final_inflight));
  if (!r.first_error.empty()) std::printf("first_error: %s\n", r.first_error.c_str());
  const bool bad = r.errors || r.double_allocs || r.stalls || r.final_inflight != 0 || r.final_free != r.final_total;
  return bad ? 1 : 0;
}
