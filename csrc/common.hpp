// kvdiag native allocators: shared configuration, errors, logging, counters.
//
// Contract of this file (pure C++, no Python):
//   Locks:        none. Logging writes whole lines with one fwrite on stderr (atomic per line).
//   GIL:          never touched here; nothing in this file calls into Python.
//   Waits:        none.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvdiag {

using page_id_t = int64_t;
using offset_t = int64_t;
using Clock = std::chrono::steady_clock;

// Everything both allocators accept. Names follow kvcached's PageAllocator where one exists.
struct AllocatorConfig {
  // kvcached's constructor arguments (fea40de order).
  int64_t num_layers = 0;
  int64_t mem_size_per_layer = 0;  // bytes of one K (or V) tensor of one layer
  int64_t page_size = 0;           // bytes
  int64_t world_size = 1;
  int64_t pp_rank = 0;
  bool async_sched = false;
  bool contiguous_layout = true;
  bool enable_prealloc = true;
  int64_t num_kv_buffers = 2;
  int64_t group_id = 0;
  int64_t min_reserved_pages = 5;   // kvcached: KVCACHED_MIN_RESERVED_PAGES
  int64_t max_reserved_pages = 10;  // kvcached: KVCACHED_MAX_RESERVED_PAGES
  double gpu_utilization = 0.95;    // kvcached: KVCACHED_GPU_UTILIZATION
  std::string ipc_name;

  // Mapping backend (kvdiag only).
  std::string backend = "host";        // "host" | "cuda"
  std::string device_name = "kvdiag0"; // host: the modelled device shared by co-located processes
  int64_t device_size = int64_t(96) << 30;
  int64_t map_latency_us = 0;          // host: injected latency per map call (models the driver)
  bool host_full_commit = false;       // host: touch every OS page instead of one per physical page
  int64_t cuda_device = 0;
  // kvcached floors mem_size_per_layer / page_size; kvdiag rejects a remainder unless asked.
  bool allow_partial_page = false;
  bool print_banner = true;

  // Bounds used only by the fixed allocator.
  int64_t wait_timeout_ms = 100;    // one slice of alloc_page's wait for in-flight pages
  int64_t map_timeout_ms = 10000;   // bound on one map and on the total wait for in-flight pages
  int64_t stop_timeout_ms = 5000;   // bound on stopping the prealloc worker
  int64_t backoff_ms = 5;           // reserve back-off while another process holds the VMM lock
};

// A bad constructor argument; `param` names it (mapped to Python ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  InvalidArgument(const std::string& param, const std::string& msg)
      : std::invalid_argument(param + ": " + msg), param_(param) {}
  const std::string& param() const { return param_; }

 private:
  std::string param_;
};

// A bounded wait or map ran out of time (fixed allocator only; Python AllocatorTimeout).
class AllocatorTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The requested backend cannot run here (e.g. no libcuda.so.1).
class BackendUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Validates `cfg` in place (throws InvalidArgument naming the parameter) and returns the pool
// size in pages (mem_size_per_layer / page_size, floored when allow_partial_page).
int64_t validate_config(const AllocatorConfig& cfg);

// kvcached's banner, byte for byte: "Init C++ PageAllocator: num_layers=..., ...".
std::string format_banner(const AllocatorConfig& cfg, int64_t min_reserved, int64_t max_reserved);

// Callbacks the allocators call from C++. The Python bindings wrap callables in bridges that
// take the GIL themselves; the core never knows about Python.
using MapCallback = std::function<void(int64_t /*world_size*/, const std::vector<offset_t>& /*offsets*/)>;
using BoolCallback = std::function<bool()>;

// Observability counters; both allocators fill them (stock: what it does, unbounded waits).
struct CounterSnapshot {
  int64_t waits = 0;           // times alloc_page had to wait for in-flight pages
  int64_t wait_timeouts = 0;   // bounded wait slices that expired (fixed only)
  int64_t sync_fallbacks = 0;  // pages mapped on the caller's thread while prealloc is enabled
  int64_t inflight_pages = 0;  // pages counted free but in neither list right now
  int64_t map_calls = 0;
  int64_t map_ns_total = 0;
  int64_t map_ns_max = 0;
  int64_t map_failures = 0;    // failed or timed-out maps/unmaps
  int64_t unmap_calls = 0;
  int64_t backoffs = 0;        // reserve back-offs because the device VMM lock was busy (fixed only)
  int64_t alloc_timeouts = 0;  // AllocatorTimeout raised by alloc_page (fixed only)
  int64_t worker_wakeups = 0;  // rounds the prealloc worker ran after a wake-up
  int64_t pages_mapped = 0;    // pages over all map calls (pages_mapped / map_calls = batch size)
  int64_t combined_maps = 0;   // synchronous maps that carried the pages of several callers (fixed only)
};

// Lock-free counters shared by both allocators.
struct Counters {
  std::atomic<int64_t> waits{0}, wait_timeouts{0}, sync_fallbacks{0}, map_calls{0}, map_ns_total{0},
      map_ns_max{0}, map_failures{0}, unmap_calls{0}, backoffs{0}, alloc_timeouts{0}, worker_wakeups{0},
      pages_mapped{0}, combined_maps{0};

  void record_map(int64_t ns, size_t pages) {
    map_calls.fetch_add(1, std::memory_order_relaxed);
    pages_mapped.fetch_add(static_cast<int64_t>(pages), std::memory_order_relaxed);
    map_ns_total.fetch_add(ns, std::memory_order_relaxed);
    int64_t prev = map_ns_max.load(std::memory_order_relaxed);
    while (ns > prev && !map_ns_max.compare_exchange_weak(prev, ns, std::memory_order_relaxed)) {
    }
  }
  CounterSnapshot snapshot(int64_t inflight) const;
};

// kvcached-style log line on stderr:
// [KVCACHED_MEMORY_POOL][LEVEL][time]file:line [p:PID t:TID]msg
// Level threshold from KVCACHED_LOG_LEVEL (first letter F/E/W/I/D/V), default WARNING.
enum class LogLevel { Fatal = 0, Error = 1, Warning = 2, Info = 3, Debug = 4, Verbose = 5 };
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define KVD_LOG(level, ...)                                                   \
  do {                                                                        \
    if (::kvdiag::log_enabled(level)) ::kvdiag::log_line(level, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define KVD_INFO(...) KVD_LOG(::kvdiag::LogLevel::Info, __VA_ARGS__)
#define KVD_WARN(...) KVD_LOG(::kvdiag::LogLevel::Warning, __VA_ARGS__)
#define KVD_ERROR(...) KVD_LOG(::kvdiag::LogLevel::Error, __VA_ARGS__)

// How the translation unit that expands KVDIAG_BUILD_INFO was compiled: the CMake build type and
// flags (compile definitions set by CMakeLists.txt) and what the compiler itself reports
// (__OPTIMIZE__, NDEBUG). benchmarks/allocator.py compares the stock and fixed strings.
#ifndef KVDIAG_BUILD_TYPE
#define KVDIAG_BUILD_TYPE "unknown build type"
#endif
#ifndef KVDIAG_CXX_FLAGS
#define KVDIAG_CXX_FLAGS "flags not recorded"
#endif
#ifdef __OPTIMIZE__
#define KVDIAG_OPT_STATE "optimized"
#else
#define KVDIAG_OPT_STATE "NOT optimized"
#endif
#ifdef NDEBUG
#define KVDIAG_NDEBUG_STATE ", NDEBUG"
#else
#define KVDIAG_NDEBUG_STATE ", assertions on"
#endif
#define KVDIAG_BUILD_INFO KVDIAG_BUILD_TYPE " (" KVDIAG_CXX_FLAGS "; " KVDIAG_OPT_STATE KVDIAG_NDEBUG_STATE ")"

inline int64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

}  // namespace kvdiag
