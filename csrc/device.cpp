// kvdiag native allocators: shared device accounting and the cross-process VMM lock.
//
// Contract of this file (pure C++, no Python):
//   Locks:   g_registry_mu (process-local, guards the per-name registries; held only for map
//            look-ups, never across I/O waits other than open()). DeviceVmmLock: a gate (gate_mu_ +
//            gate_cv_, held only to flip gate_busy_) + flock on the lock file, taken only by the
//            gate's holder (maps/unmaps, and busy_elsewhere's non-blocking probe). DeviceAccount: flock on the accounting file while claiming a slot.
//   GIL:     never touched; nothing here calls into Python.
//   Waits:   DeviceVmmLock::lock() is unbounded by design (stock model). lock_until() polls
//            flock(LOCK_NB) until its deadline. Slot claiming holds flock for a few microseconds.
#include "device.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

namespace kvdiag {

namespace {

constexpr uint64_t kMagic = 0x6b76646961674163ULL;  // "kvdiagAc"
constexpr int kSlots = 256;

std::string shm_dir() {
  struct stat st;
  if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return "/tmp";
}

bool pid_alive(int32_t pid) {
  if (pid <= 0) return false;
  if (pid == getpid()) return true;
  return kill(pid, 0) == 0 || errno == EPERM;
}

int flock_retry(int fd, int op) {
  int rc;
  do {
    rc = flock(fd, op);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

int open_shared(const std::string& path) {
  // 0666 so co-located processes of other users can share the modelled device.
  mode_t old = umask(0);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  umask(old);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  return fd;
}

std::mutex g_registry_mu;
std::map<std::string, std::weak_ptr<DeviceAccount>>& account_registry() {
  static auto* m = new std::map<std::string, std::weak_ptr<DeviceAccount>>();
  return *m;
}
// Strong references held by register_device_usage so the weights stay registered.
std::map<std::string, std::shared_ptr<DeviceAccount>>& pinned_accounts() {
  static auto* m = new std::map<std::string, std::shared_ptr<DeviceAccount>>();
  return *m;
}

}  // namespace

struct DeviceAccount::Header {
  uint64_t magic;
  uint64_t version;
  uint64_t pad[6];
};

struct DeviceAccount::Slot {
  std::atomic<int32_t> pid;
  int32_t pad;
  std::atomic<int64_t> kv_bytes;
  std::atomic<int64_t> weight_bytes;
  int64_t pad2;
};

std::string device_lock_path(const std::string& device_name) {
  return shm_dir() + "/kvdiag-vmm-" + device_name + ".lock";
}

std::string device_account_path(const std::string& device_name) {
  return shm_dir() + "/kvdiag-dev-" + device_name + ".acct";
}

std::shared_ptr<DeviceAccount> DeviceAccount::open(const std::string& device_name) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto& reg = account_registry();
  auto it = reg.find(device_name);
  if (it != reg.end()) {
    if (auto sp = it->second.lock()) return sp;
  }
  std::shared_ptr<DeviceAccount> sp(new DeviceAccount(device_name));
  reg[device_name] = sp;
  return sp;
}

DeviceAccount::DeviceAccount(const std::string& device_name)
    : path_(device_account_path(device_name)), lock_path_(device_lock_path(device_name)) {
  static_assert(sizeof(Slot) == 32, "slot layout is shared between processes");
  static_assert(std::atomic<int64_t>::is_always_lock_free, "shared atomics must be lock free");
  size_ = sizeof(Header) + kSlots * sizeof(Slot);
  for (;;) {
    fd_ = open_shared(path_);
    if (flock_retry(fd_, LOCK_EX) != 0) {
      ::close(fd_);
      throw std::runtime_error("flock " + path_ + " failed: " + std::strerror(errno));
    }
    // The last user may have unlinked the file while we waited for its lock: start over.
    struct stat held, named;
    if (fstat(fd_, &held) == 0 && stat(path_.c_str(), &named) == 0 && held.st_ino == named.st_ino &&
        held.st_dev == named.st_dev)
      break;
    ::close(fd_);
  }
  struct stat st;
  bool ok = fstat(fd_, &st) == 0 && (static_cast<size_t>(st.st_size) >= size_ || ftruncate(fd_, size_) == 0);
  if (ok) {
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    ok = base_ != MAP_FAILED;
  }
  if (!ok) {
    std::string err = std::strerror(errno);
    flock_retry(fd_, LOCK_UN);
    ::close(fd_);
    throw std::runtime_error("cannot map " + path_ + ": " + err);
  }
  auto* hdr = static_cast<Header*>(base_);
  auto* slots = reinterpret_cast<Slot*>(hdr + 1);
  if (hdr->magic != kMagic) {
    std::memset(base_, 0, size_);
    hdr->magic = kMagic;
    hdr->version = 1;
  }
  const int32_t me = getpid();
  Slot* mine = nullptr;
  for (int i = 0; i < kSlots && !mine; ++i)
    if (slots[i].pid.load() == me) mine = &slots[i];
  for (int i = 0; i < kSlots && !mine; ++i) {
    if (!pid_alive(slots[i].pid.load())) {
      mine = &slots[i];
      mine->kv_bytes.store(0);
      mine->weight_bytes.store(0);
      mine->pid.store(me);
    }
  }
  flock_retry(fd_, LOCK_UN);
  if (!mine) {
    munmap(base_, size_);
    ::close(fd_);
    throw std::runtime_error("device accounting file " + path_ + " has no free slot (256 live processes)");
  }
  slot_ = mine;
}

DeviceAccount::~DeviceAccount() {
  if (slot_) {
    flock_retry(fd_, LOCK_EX);
    // Leave the slot empty so other processes stop counting us at once.
    slot_->kv_bytes.store(0);
    slot_->weight_bytes.store(0);
    slot_->pid.store(0);
    // The last live user removes the device's files so /dev/shm does not fill up. Anyone who
    // opened them meanwhile re-checks the inode after taking the flock (see the constructor).
    auto* slots = reinterpret_cast<Slot*>(static_cast<Header*>(base_) + 1);
    bool anyone = false;
    for (int i = 0; i < kSlots && !anyone; ++i) anyone = pid_alive(slots[i].pid.load());
    if (!anyone) {
      ::unlink(lock_path_.c_str());
      ::unlink(path_.c_str());
    }
    flock_retry(fd_, LOCK_UN);
  }
  if (base_ && base_ != MAP_FAILED) munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void DeviceAccount::add_kv_bytes(int64_t delta) { slot_->kv_bytes.fetch_add(delta); }

void DeviceAccount::set_weight_bytes(int64_t bytes) { slot_->weight_bytes.store(bytes); }

int64_t DeviceAccount::own_kv_bytes() const { return slot_->kv_bytes.load(); }

int64_t DeviceAccount::used_bytes_all() const {
  auto* slots = reinterpret_cast<Slot*>(static_cast<Header*>(base_) + 1);
  int64_t total = 0;
  for (int i = 0; i < kSlots; ++i) {
    int32_t pid = slots[i].pid.load(std::memory_order_relaxed);
    if (pid == 0 || !pid_alive(pid)) continue;
    total += slots[i].kv_bytes.load(std::memory_order_relaxed) +
             slots[i].weight_bytes.load(std::memory_order_relaxed);
  }
  return total;
}

void DeviceAccount::unlink_if_sole_user() {
  if (!slot_) return;
  flock_retry(fd_, LOCK_EX);
  auto* slots = reinterpret_cast<Slot*>(static_cast<Header*>(base_) + 1);
  bool others = false;
  for (int i = 0; i < kSlots && !others; ++i) {
    int32_t pid = slots[i].pid.load();
    others = pid != 0 && pid != getpid() && pid_alive(pid);
  }
  if (!others) {
    ::unlink(lock_path_.c_str());
    ::unlink(path_.c_str());
  }
  flock_retry(fd_, LOCK_UN);
}

bool remove_stale_device_files(const std::string& device_name) {
  const std::string acct = device_account_path(device_name);
  const std::string lock = device_lock_path(device_name);
  int fd = ::open(acct.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    // Every user of the lock file holds a slot in the accounting file, so a lone lock file is stale.
    return ::unlink(lock.c_str()) == 0;
  }
  bool removed = false;
  if (flock_retry(fd, LOCK_EX) == 0) {
    const size_t size = sizeof(DeviceAccount::Header) + kSlots * sizeof(DeviceAccount::Slot);
    struct stat st;
    bool live = false;
    if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= size) {
      void* base = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED) {
        live = true;  // cannot tell: keep the files
      } else {
        auto* slots = reinterpret_cast<const DeviceAccount::Slot*>(static_cast<const DeviceAccount::Header*>(base) + 1);
        for (int i = 0; i < kSlots && !live; ++i) live = pid_alive(slots[i].pid.load());
        munmap(base, size);
      }
    }
    if (!live) {
      ::unlink(lock.c_str());
      removed = ::unlink(acct.c_str()) == 0;
    }
    flock_retry(fd, LOCK_UN);
  }
  ::close(fd);
  return removed;
}

void device_exit_cleanup() {
  std::vector<std::shared_ptr<DeviceAccount>> all;
  {
    std::lock_guard<std::mutex> g(g_registry_mu);
    for (auto& kv : account_registry())
      if (auto sp = kv.second.lock()) all.push_back(sp);
  }
  for (auto& a : all) a->unlink_if_sole_user();
}

void register_device_usage(const std::string& device_name, int64_t bytes) {
  if (bytes < 0) throw InvalidArgument("bytes", "must be >= 0, got " + std::to_string(bytes));
  auto acct = DeviceAccount::open(device_name);
  acct->set_weight_bytes(bytes);
  std::shared_ptr<DeviceAccount> unpinned;  // released after the registry lock
  std::lock_guard<std::mutex> g(g_registry_mu);
  if (bytes > 0) {
    pinned_accounts()[device_name] = acct;
  } else {
    auto it = pinned_accounts().find(device_name);
    if (it != pinned_accounts().end()) {
      unpinned = std::move(it->second);
      pinned_accounts().erase(it);
    }
  }
}

int64_t device_used_bytes(const std::string& device_name) {
  return DeviceAccount::open(device_name)->used_bytes_all();
}

DeviceVmmLock::DeviceVmmLock(const std::string& device_name) : presence_(DeviceAccount::open(device_name)) {
  const std::string path = device_lock_path(device_name);
  fd_ = open_shared(path);
}

DeviceVmmLock::~DeviceVmmLock() {
  if (fd_ >= 0) ::close(fd_);
}

bool DeviceVmmLock::gate_wait(std::unique_lock<std::mutex>& g, const Clock::time_point* deadline) {
  auto free_now = [&] { return !gate_busy_; };
  if (deadline == nullptr) {
    gate_cv_.wait(g, free_now);
  } else if (!gate_cv_.wait_until(g, *deadline, free_now)) {
    return false;
  }
  gate_busy_ = true;
  return true;
}

void DeviceVmmLock::gate_release() {
  {
    std::lock_guard<std::mutex> g(gate_mu_);
    gate_busy_ = false;
  }
  gate_cv_.notify_one();
}

void DeviceVmmLock::lock() {
  {
    std::unique_lock<std::mutex> g(gate_mu_);
    gate_wait(g, nullptr);
  }
  if (flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
  blocked_elsewhere_.store(true);
  flock_retry(fd_, LOCK_EX);
  blocked_elsewhere_.store(false);
}

bool DeviceVmmLock::lock_until(Clock::time_point deadline) {
  {
    std::unique_lock<std::mutex> g(gate_mu_);
    if (!gate_wait(g, &deadline)) return false;
  }
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    if (flock(fd_, LOCK_EX | LOCK_NB) == 0) {
      blocked_elsewhere_.store(false);
      return true;
    }
    blocked_elsewhere_.store(true);
    auto now = Clock::now();
    if (now >= deadline) {
      blocked_elsewhere_.store(false);
      gate_release();
      return false;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::microseconds(2000));
  }
}

void DeviceVmmLock::unlock() {
  flock_retry(fd_, LOCK_UN);
  gate_release();
}

bool DeviceVmmLock::busy_elsewhere() {
  // The probe takes this process's gate, so it never overlaps a map of our own: a map that
  // arrives meanwhile waits on the gate (woken by gate_release) instead of finding the file lock
  // taken and polling. If the gate is taken, one of our threads holds the file lock (a map of our
  // own: not "elsewhere") or is blocked on it, which means someone else holds it.
  {
    std::lock_guard<std::mutex> g(gate_mu_);
    if (gate_busy_) return blocked_elsewhere_.load();
    gate_busy_ = true;
  }
  bool busy = false;
  if (flock(fd_, LOCK_EX | LOCK_NB) == 0)
    flock_retry(fd_, LOCK_UN);
  else
    busy = errno == EWOULDBLOCK;
  gate_release();
  return busy;
}

}  // namespace kvdiag
