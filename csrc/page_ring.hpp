// kvdiag native allocators: PageRing, the fixed allocator's page lists, and LineArray /
// LineAllocator, heap storage on cache lines of its own (no false sharing with heap neighbours).
//
// Contract of this file (pure C++, no Python):
//   Locks:   none; a PageRing or LineArray is not thread-safe, its owner guards it (the fixed
//            allocator's mu_; the stress driver's ownership flags are atomics).
//   GIL:     never touched.
//   Waits:   none. Every operation is O(1) and never allocates after construction, so the
//            owner's lock is held for a few instructions per page (std::deque allocates blocks
//            as it moves and computes size() from its iterators).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>

#include "common.hpp"

namespace kvdiag {

// A heap array that starts on a cache line and fills whole lines, so no other heap object (the
// caller's data, another allocator's state) shares a line with it. The allocator's per-page
// arrays are written on every alloc/free; a neighbour on the same line written by other threads
// would bounce it between cores on every op (false sharing), for reasons outside the allocator.
// T must be trivially destructible (page ids, flags, atomics of them).
template <class T>
class LineArray {
 public:
  static constexpr size_t kLine = 64;
  LineArray() = default;
  template <class V>
  LineArray(size_t n, const V& v) { assign(n, v); }
  template <class V>
  void assign(size_t n, const V& v) {
    const size_t bytes = std::max<size_t>(kLine, (n * sizeof(T) + kLine - 1) / kLine * kLine);
    data_.reset(static_cast<T*>(::operator new(bytes, std::align_val_t{kLine})));
    for (size_t i = 0; i < n; ++i) new (data_.get() + i) T(v);
    n_ = n;
  }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete(p, std::align_val_t{kLine}); }
  };
  std::unique_ptr<T[], Free> data_;
  size_t n_ = 0;
};

// A std::allocator that gives every block whole cache lines of its own (see LineArray): for a
// small per-thread vector written on every op, which malloc would otherwise place next to
// another thread's (threads may share an arena), bouncing one line between cores.
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    return static_cast<T*>(::operator new(bytes, std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};

// A fixed-capacity double-ended queue of page ids (a circular buffer).
class PageRing {
 public:
  explicit PageRing(size_t capacity) : buf_(capacity > 0 ? capacity : 1, page_id_t{0}) {
    if (buf_.size() > UINT32_MAX) throw std::length_error("PageRing: more than 2^32 pages");
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  page_id_t front() const { return buf_[head_]; }
  page_id_t back() const { return buf_[wrap(size_t{head_} + size_ - 1)]; }
  page_id_t operator[](size_t i) const { return buf_[wrap(size_t{head_} + i)]; }

  void push_back(page_id_t id) {
    grow_check();
    buf_[wrap(size_t{head_} + size_)] = id;
    ++size_;
  }
  void push_front(page_id_t id) {
    grow_check();
    head_ = static_cast<uint32_t>(head_ == 0 ? buf_.size() - 1 : head_ - 1);
    buf_[head_] = id;
    ++size_;
  }
  page_id_t pop_front() {
    const page_id_t id = buf_[head_];
    head_ = static_cast<uint32_t>(wrap(size_t{head_} + 1));
    --size_;
    return id;
  }
  page_id_t pop_back() {
    --size_;
    return buf_[wrap(size_t{head_} + size_)];
  }
  void clear() { head_ = size_ = 0; }

 private:
  size_t wrap(size_t i) const { return i >= buf_.size() ? i - buf_.size() : i; }
  // Every page id is in at most one list, so a ring sized to the pool never fills; a full ring
  // is a bookkeeping bug, reported rather than silently overwriting a page id.
  void grow_check() const {
    if (size_t{size_} == buf_.size()) throw std::logic_error("PageRing overflow: a page id is in two lists");
  }

  // head_ and size_ first and 32-bit: they are what push/pop write, and the fixed allocator keeps
  // them on the same cache line as its mutex (buf_'s pointer is only read).
  uint32_t head_ = 0;
  uint32_t size_ = 0;
  LineArray<page_id_t> buf_;
};

}  // namespace kvdiag
