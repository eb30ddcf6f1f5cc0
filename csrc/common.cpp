// kvdiag native allocators: configuration validation, kvcached banner, logging.
//
// Contract of this file (pure C++, no Python):
//   Locks:        none (the log level is read once into a function-local static).
//   GIL:          never touched; nothing here calls into Python.
//   Waits:        none.
#include "common.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>

namespace kvdiag {

namespace {

bool safe_name(const std::string& s) {
  if (s.empty() || s.size() > 100) return false;
  for (char c : s) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.';
    if (!ok) return false;
  }
  return s != "." && s != "..";
}

void require(bool ok, const char* param, const std::string& msg) {
  if (!ok) throw InvalidArgument(param, msg);
}

}  // namespace

int64_t validate_config(const AllocatorConfig& c) {
  require(c.num_layers > 0, "num_layers", "must be positive, got " + std::to_string(c.num_layers));
  require(c.mem_size_per_layer > 0, "mem_size_per_layer",
          "must be positive, got " + std::to_string(c.mem_size_per_layer));
  require(c.page_size > 0, "page_size", "must be positive, got " + std::to_string(c.page_size));
  require(c.page_size <= c.mem_size_per_layer, "page_size",
          "is larger than mem_size_per_layer (" + std::to_string(c.page_size) + " > " +
              std::to_string(c.mem_size_per_layer) + ")");
  require(c.allow_partial_page || c.mem_size_per_layer % c.page_size == 0, "page_size",
          "must divide mem_size_per_layer (" + std::to_string(c.mem_size_per_layer) + " % " +
              std::to_string(c.page_size) + " = " + std::to_string(c.mem_size_per_layer % c.page_size) +
              "); pass allow_partial_page=True to floor like kvcached");
  require(c.num_kv_buffers == 1 || c.num_kv_buffers == 2, "num_kv_buffers",
          "must be 1 (MLA) or 2 (K and V), got " + std::to_string(c.num_kv_buffers));
  require(c.world_size >= 1, "world_size", "must be >= 1, got " + std::to_string(c.world_size));
  require(c.pp_rank >= 0, "pp_rank", "must be >= 0, got " + std::to_string(c.pp_rank));
  require(c.group_id >= 0, "group_id", "must be >= 0, got " + std::to_string(c.group_id));
  require(c.min_reserved_pages >= 0, "min_reserved_pages",
          "must be >= 0, got " + std::to_string(c.min_reserved_pages));
  require(c.max_reserved_pages >= 0, "max_reserved_pages",
          "must be >= 0, got " + std::to_string(c.max_reserved_pages));
  require(c.min_reserved_pages <= c.max_reserved_pages, "min_reserved_pages",
          "must be <= max_reserved_pages (" + std::to_string(c.min_reserved_pages) + " > " +
              std::to_string(c.max_reserved_pages) + ")");
  // Written so that NaN fails too.
  require(c.gpu_utilization > 0.0 && c.gpu_utilization <= 1.0, "gpu_utilization",
          "must be in (0, 1], got " + std::to_string(c.gpu_utilization));
  require(c.backend == "host" || c.backend == "cuda", "backend",
          "must be 'host' or 'cuda', got '" + c.backend + "'");
  require(safe_name(c.device_name), "device_name",
          "must be 1-100 characters of [A-Za-z0-9._-], got '" + c.device_name + "'");
  require(c.ipc_name.empty() || safe_name(c.ipc_name), "ipc_name",
          "must be empty or 1-100 characters of [A-Za-z0-9._-], got '" + c.ipc_name + "'");
  require(c.device_size > 0, "device_size", "must be positive, got " + std::to_string(c.device_size));
  require(c.map_latency_us >= 0, "map_latency_us", "must be >= 0, got " + std::to_string(c.map_latency_us));
  require(c.cuda_device >= 0, "cuda_device", "must be >= 0, got " + std::to_string(c.cuda_device));
  require(c.wait_timeout_ms > 0, "wait_timeout_ms", "must be positive");
  require(c.map_timeout_ms > 0, "map_timeout_ms", "must be positive");
  require(c.stop_timeout_ms > 0, "stop_timeout_ms", "must be positive");
  require(c.backoff_ms > 0, "backoff_ms", "must be positive");
  if (c.backend == "host") {
    long os_page = sysconf(_SC_PAGESIZE);
    require(c.page_size % os_page == 0, "page_size",
            "must be a multiple of the OS page size (" + std::to_string(os_page) + ") for the host backend");
  }
  return c.mem_size_per_layer / c.page_size;
}

std::string format_banner(const AllocatorConfig& c, int64_t min_reserved, int64_t max_reserved) {
  const int64_t mb = 1024 * 1024;
  const int64_t total = c.num_kv_buffers * c.num_layers * c.mem_size_per_layer;
  std::ostringstream os;
  os << "Init C++ PageAllocator: num_layers=" << c.num_layers
     << ", mem_size_per_layer=" << c.mem_size_per_layer / mb << "MB"
     << ", total_mem_size=" << total / mb << "MB"
     << ", page_size=" << c.page_size / mb << "MB"
     << ", world_size=" << c.world_size << ", pp_rank=" << c.pp_rank
     << ", async_sched=" << (c.async_sched ? 1 : 0)
     << ", contiguous_layout=" << (c.contiguous_layout ? 1 : 0)
     << ", enable_prealloc=" << (c.enable_prealloc ? 1 : 0)
     << ", num_kv_buffers=" << c.num_kv_buffers << ", group_id=" << c.group_id
     << ", min_reserved_pages=" << min_reserved << ", max_reserved_pages=" << max_reserved;
  return os.str();
}

CounterSnapshot Counters::snapshot(int64_t inflight) const {
  CounterSnapshot s;
  s.waits = waits.load();
  s.wait_timeouts = wait_timeouts.load();
  s.sync_fallbacks = sync_fallbacks.load();
  s.inflight_pages = inflight;
  s.map_calls = map_calls.load();
  s.map_ns_total = map_ns_total.load();
  s.map_ns_max = map_ns_max.load();
  s.map_failures = map_failures.load();
  s.unmap_calls = unmap_calls.load();
  s.backoffs = backoffs.load();
  s.alloc_timeouts = alloc_timeouts.load();
  s.worker_wakeups = worker_wakeups.load();
  s.pages_mapped = pages_mapped.load();
  s.combined_maps = combined_maps.load();
  return s;
}

namespace {

LogLevel threshold() {
  static const LogLevel level = [] {
    const char* env = std::getenv("KVCACHED_LOG_LEVEL");
    if (env == nullptr || env[0] == '\0') return LogLevel::Warning;
    switch (env[0]) {
      case 'F': case 'f': return LogLevel::Fatal;
      case 'E': case 'e': return LogLevel::Error;
      case 'W': case 'w': return LogLevel::Warning;
      case 'I': case 'i': return LogLevel::Info;
      case 'D': case 'd': return LogLevel::Debug;
      case 'V': case 'v': return LogLevel::Verbose;
      default: return LogLevel::Warning;
    }
  }();
  return level;
}

}  // namespace

bool log_enabled(LogLevel level) { return static_cast<int>(level) <= static_cast<int>(threshold()); }

void log_line(LogLevel level, const char* file, int line, const char* fmt, ...) {
  static const char* names[] = {"FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "VERBOSE"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char stamp[32];
  time_t now = time(nullptr);
  struct tm tmv;
  localtime_r(&now, &tmv);
  strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &tmv);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  char out[1400];
  int n = snprintf(out, sizeof out, "[KVCACHED_MEMORY_POOL][%s][%s]%s:%d [p:%d t:%ld]%s\n",
                   names[static_cast<int>(level)], stamp, base, line, static_cast<int>(getpid()),
                   static_cast<long>(syscall(SYS_gettid)), msg);
  if (n > 0) fwrite(out, 1, std::min<size_t>(static_cast<size_t>(n), sizeof out - 1), stderr);
}

}  // namespace kvdiag
