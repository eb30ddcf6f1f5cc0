// kvdiag native allocators: the modelled device shared by co-located processes.
//
// Contract of this file (pure C++, no Python):
//   Locks:   DeviceVmmLock = a process-local gate (mutex + condvar) + flock(LOCK_EX) on
//            /dev/shm/kvdiag-vmm-<device>.lock. It models the driver's device-wide VMM
//            serialization: every host-backend map/unmap holds it. DeviceAccount takes
//            flock(LOCK_EX) on /dev/shm/kvdiag-dev-<device>.acct only while claiming or releasing
//            a slot; byte counts are lock-free atomics in the shared mapping. The last live user
//            of a device unlinks both files.
//   GIL:     never touched; nothing here calls into Python.
//   Waits:   DeviceVmmLock::lock() is UNBOUNDED (the stock model: a driver call that waits as long
//            as it must). lock_until() is bounded by its deadline (polling LOCK_NB with a capped
//            back-off). Everything else is non-blocking apart from the short slot-claim flock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common.hpp"

namespace kvdiag {

// Per-process view of the shared accounting file of one modelled device. Each live process owns one
// slot: KV bytes its allocators have mapped and "weights" bytes it registered. Slots of dead
// processes are ignored and reused.
class DeviceAccount {
 public:
  // One instance per device name per process (shared).
  static std::shared_ptr<DeviceAccount> open(const std::string& device_name);
  ~DeviceAccount();
  DeviceAccount(const DeviceAccount&) = delete;
  DeviceAccount& operator=(const DeviceAccount&) = delete;

  void add_kv_bytes(int64_t delta);
  void set_weight_bytes(int64_t bytes);
  // Bytes held on the device by every live process (this one included).
  int64_t used_bytes_all() const;
  int64_t own_kv_bytes() const;
  // Unlinks the device's files when no other live process holds a slot (used at exit; our own
  // mapping stays valid until the process ends).
  void unlink_if_sole_user();

  // Shared-file layout (defined in device.cpp).
  struct Slot;
  struct Header;

 private:
  explicit DeviceAccount(const std::string& device_name);
  std::string path_;
  std::string lock_path_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t size_ = 0;
  Slot* slot_ = nullptr;
};

// Device-wide VMM lock shared across processes (flock) and threads (a mutex+condvar gate; not a
// timed_mutex, whose clocklock ThreadSanitizer does not intercept).
class DeviceVmmLock {
 public:
  explicit DeviceVmmLock(const std::string& device_name);
  ~DeviceVmmLock();
  DeviceVmmLock(const DeviceVmmLock&) = delete;
  DeviceVmmLock& operator=(const DeviceVmmLock&) = delete;

  void lock();                                       // unbounded (stock model)
  bool lock_until(Clock::time_point deadline);       // bounded
  void unlock();
  // True when another process (or another DeviceVmmLock object) holds the lock right now.
  // Non-blocking; false while a thread of this object holds it.
  bool busy_elsewhere();

 private:
  bool gate_wait(std::unique_lock<std::mutex>& g, const Clock::time_point* deadline);
  void gate_release();
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool gate_busy_ = false;
  // The gate's holder found the file lock taken (by another process or DeviceVmmLock object)
  // and is waiting for it.
  std::atomic<bool> blocked_elsewhere_{false};
  // A slot in the device's accounting file marks this process as a user of the device, so the
  // last user's cleanup never unlinks a lock file that is still in use.
  std::shared_ptr<DeviceAccount> presence_;
  int fd_ = -1;
};

// Path helpers (exposed for tests and the Python layer).
std::string device_lock_path(const std::string& device_name);
std::string device_account_path(const std::string& device_name);

// Register this process's non-KV usage ("weights") on a modelled device; replaces the earlier value.
// A positive value keeps the registration for the process lifetime; 0 drops it.
void register_device_usage(const std::string& device_name, int64_t bytes);
// Bytes in use on a modelled device by all live processes.
int64_t device_used_bytes(const std::string& device_name);
// Removes a device's files if no live process uses it (e.g. after a fixture was SIGKILLed).
// Returns true if something was removed.
bool remove_stale_device_files(const std::string& device_name);
// At interpreter exit: unlink the files of every device this process is the last user of.
void device_exit_cleanup();

}  // namespace kvdiag
