// kvdiag native allocators: the mapping backend interface (host memory or CUDA VMM).
//
// Contract of this file (pure C++, no Python):
//   Locks:   every implementation holds the device's DeviceVmmLock during each map/unmap call and
//            its own small state mutex (mapped-page bookkeeping) only for non-blocking updates.
//   GIL:     never touched; backends never call into Python.
//   Waits:   map/unmap with deadline == nullopt wait for the device lock without bound (stock
//            model). With a deadline, the lock wait and injected latency are bounded by it and the
//            call returns MapStatus::Timeout. CUDA driver calls themselves cannot be bounded.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"

namespace kvdiag {

enum class MapStatus { Ok, Timeout, OutOfMemory, Error };

struct MapOutcome {
  MapStatus status = MapStatus::Ok;
  std::string message;
  bool ok() const { return status == MapStatus::Ok; }
};

const char* map_status_name(MapStatus s);

// Physical backing of page ids. A page id is num_layers * num_kv_buffers physical pages of
// page_size bytes, laid out like kvcached's KV tensors (contiguous or per-layer).
class MappingBackend {
 public:
  virtual ~MappingBackend() = default;
  virtual const char* name() const = 0;
  virtual MapOutcome map(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) = 0;
  virtual MapOutcome unmap(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) = 0;
  // Device memory in bytes, like cudaMemGetInfo.
  virtual void mem_get_info(size_t* free_bytes, size_t* total_bytes) = 0;
  // True when another process holds the device's VMM lock right now (non-blocking probe).
  virtual bool vmm_busy_elsewhere() = 0;
  // Number of page ids currently mapped.
  virtual int64_t mapped_pages() const = 0;
};

// Builds the backend named by cfg.backend for a pool of `num_pages` page ids.
// Throws BackendUnavailable (e.g. backend="cuda" without libcuda) or InvalidArgument.
std::unique_ptr<MappingBackend> make_backend(const AllocatorConfig& cfg, int64_t num_pages);

std::unique_ptr<MappingBackend> make_host_backend(const AllocatorConfig& cfg, int64_t num_pages);
std::unique_ptr<MappingBackend> make_cuda_backend(const AllocatorConfig& cfg, int64_t num_pages);

// Byte offsets of page ids inside the KV tensors, as kvcached computes them for map_to_kv_tensors.
std::vector<offset_t> page_offsets(const AllocatorConfig& cfg, const std::vector<page_id_t>& ids);

}  // namespace kvdiag
