// kvdiag._native: nanobind bindings for the stock and fixed page allocators.
//
// Contract of this file:
//   Locks:   none of its own; the allocators' locks are described in their headers. The atexit
//            registry of fixed allocators has a small mutex (g_live_mu) held only for list edits.
//   GIL:     StockPageAllocator: NO method releases the GIL (kvcached fea40de), alloc_page and
//            stop_prealloc_thread included; only the kvdiag-only wait_prealloc_idle releases it.
//            FixedPageAllocator: every method that can block runs under gil_scoped_release
//            (alloc_page and free_page after a non-blocking try on the fast path, free_pages,
//            resize, trim, start/stop, trigger, wait_prealloc_idle, get_avail_physical_pages).
//            Module functions stress() and DeviceVmmLock.acquire() release it too.
//   Python:  PyMapBridge / PyBoolBridge wrap Python callables for C++. Every call and the final
//            decref take the GIL with nb::gil_scoped_acquire (PyGILState_Ensure), from whatever
//            thread calls them — so a stock prealloc worker blocks in take_gil while another
//            thread holds the GIL. The fixed allocator calls should_use_worker_ipc callables once,
//            on the caller's thread (set_should_use_worker_ipc_callback).
//   Waits:   no waits here beyond those of the allocators; FixedHandle's destructor stops the
//            worker with the GIL released (bounded by stop_timeout_ms).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "common.hpp"
#include "device.hpp"
#include "fixed_allocator.hpp"
#include "stock_allocator.hpp"
#include "stress.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvdiag {
namespace bindings {

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Owns one reference to a Python object; the decref takes the GIL (it may run on a C++ thread).
struct PyRef {
  PyObject* obj;
  explicit PyRef(nb::handle h) : obj(h.ptr()) { Py_INCREF(obj); }
  ~PyRef() {
    if (!interpreter_alive()) return;  // leak rather than touch a dying interpreter
    nb::gil_scoped_acquire acquire;
    Py_DECREF(obj);
  }
};

std::string describe_python_error(nb::python_error& e) {
  std::string type = nb::borrow<nb::str>(nb::handle(e.type()).attr("__name__")).c_str();
  std::string value = nb::str(e.value()).c_str();
  return type + ": " + value;
}

// broadcast_map_callback(world_size, offsets) / broadcast_unmap_callback, callable from any thread.
struct PyMapBridge {
  std::shared_ptr<PyRef> fn;
  __attribute__((noinline)) void operator()(int64_t world_size, const std::vector<offset_t>& offsets) const {
    nb::gil_scoped_acquire acquire;  // a C++ worker waits here (PyGILState_Ensure -> take_gil)
    try {
      nb::list lst;
      for (offset_t o : offsets) lst.append(o);
      nb::handle(fn->obj)(world_size, lst);
    } catch (nb::python_error& e) {
      throw std::runtime_error(describe_python_error(e));
    }
  }
};

// should_use_worker_ipc(), callable from any thread.
struct PyBoolBridge {
  std::shared_ptr<PyRef> fn;
  __attribute__((noinline)) bool operator()() const {
    nb::gil_scoped_acquire acquire;  // a C++ worker waits here (PyGILState_Ensure -> take_gil)
    try {
      nb::object r = nb::handle(fn->obj)();
      int truth = PyObject_IsTrue(r.ptr());
      if (truth < 0) throw nb::python_error();
      return truth == 1;
    } catch (nb::python_error& e) {
      throw std::runtime_error(describe_python_error(e));
    }
  }
};

MapCallback make_map_callback(nb::handle cb) {
  if (cb.is_none()) return MapCallback();
  if (!PyCallable_Check(cb.ptr())) throw nb::type_error("callback must be callable or None");
  return PyMapBridge{std::make_shared<PyRef>(cb)};
}

BoolCallback make_bool_callback(nb::handle cb) {
  if (cb.is_none()) return BoolCallback();
  if (!PyCallable_Check(cb.ptr())) throw nb::type_error("callback must be callable or None");
  return PyBoolBridge{std::make_shared<PyRef>(cb)};
}

// ---- keyword parsing shared by both classes and stress() -------------------------------------

int64_t as_int(nb::handle v, const std::string& key) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr()))
    throw nb::type_error((key + ": expected int, got " + std::string(Py_TYPE(v.ptr())->tp_name)).c_str());
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow) throw nb::value_error((key + ": out of range").c_str());
  return static_cast<int64_t>(x);
}

bool as_bool(nb::handle v, const std::string& key) {
  if (PyBool_Check(v.ptr())) return v.ptr() == Py_True;
  if (PyLong_Check(v.ptr())) return as_int(v, key) != 0;
  throw nb::type_error((key + ": expected bool, got " + std::string(Py_TYPE(v.ptr())->tp_name)).c_str());
}

double as_float(nb::handle v, const std::string& key) {
  if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())))
    throw nb::type_error((key + ": expected float, got " + std::string(Py_TYPE(v.ptr())->tp_name)).c_str());
  return PyFloat_AsDouble(v.ptr());
}

std::string as_str(nb::handle v, const std::string& key) {
  if (!PyUnicode_Check(v.ptr()))
    throw nb::type_error((key + ": expected str, got " + std::string(Py_TYPE(v.ptr())->tp_name)).c_str());
  return nb::borrow<nb::str>(v).c_str();
}

// Applies one keyword to cfg; false if the key is not a config key.
bool apply_config_key(AllocatorConfig& c, const std::string& key, nb::handle v) {
  if (key == "num_layers") c.num_layers = as_int(v, key);
  else if (key == "mem_size_per_layer") c.mem_size_per_layer = as_int(v, key);
  else if (key == "page_size") c.page_size = as_int(v, key);
  else if (key == "world_size") c.world_size = as_int(v, key);
  else if (key == "pp_rank") c.pp_rank = as_int(v, key);
  else if (key == "async_sched") c.async_sched = as_bool(v, key);
  else if (key == "contiguous_layout") c.contiguous_layout = as_bool(v, key);
  else if (key == "enable_prealloc" || key == "enable_page_prealloc") c.enable_prealloc = as_bool(v, key);
  else if (key == "num_kv_buffers") c.num_kv_buffers = as_int(v, key);
  else if (key == "group_id") c.group_id = as_int(v, key);
  else if (key == "min_reserved_pages") c.min_reserved_pages = as_int(v, key);
  else if (key == "max_reserved_pages") c.max_reserved_pages = as_int(v, key);
  else if (key == "gpu_utilization") c.gpu_utilization = as_float(v, key);
  else if (key == "ipc_name") c.ipc_name = as_str(v, key);
  else if (key == "backend") c.backend = as_str(v, key);
  else if (key == "device_name") c.device_name = as_str(v, key);
  else if (key == "device_size") c.device_size = as_int(v, key);
  else if (key == "map_latency_us") c.map_latency_us = as_int(v, key);
  else if (key == "host_full_commit") c.host_full_commit = as_bool(v, key);
  else if (key == "cuda_device") c.cuda_device = as_int(v, key);
  else if (key == "allow_partial_page") c.allow_partial_page = as_bool(v, key);
  else if (key == "print_banner") c.print_banner = as_bool(v, key);
  else if (key == "wait_timeout_ms") c.wait_timeout_ms = as_int(v, key);
  else if (key == "map_timeout_ms") c.map_timeout_ms = as_int(v, key);
  else if (key == "stop_timeout_ms") c.stop_timeout_ms = as_int(v, key);
  else if (key == "backoff_ms") c.backoff_ms = as_int(v, key);
  else return false;
  return true;
}

AllocatorConfig parse_config(int64_t num_layers, int64_t mem_size_per_layer, int64_t page_size, const nb::kwargs& kw) {
  AllocatorConfig c;
  c.num_layers = num_layers;
  c.mem_size_per_layer = mem_size_per_layer;
  c.page_size = page_size;
  for (auto item : kw) {
    std::string key = nb::borrow<nb::str>(item.first).c_str();
    if (!apply_config_key(c, key, item.second))
      throw nb::type_error(("unexpected keyword argument '" + key + "'").c_str());
  }
  return c;
}

nb::dict counters_dict(const CounterSnapshot& s) {
  nb::dict d;
  d["waits"] = s.waits;
  d["wait_timeouts"] = s.wait_timeouts;
  d["sync_fallbacks"] = s.sync_fallbacks;
  d["inflight_pages"] = s.inflight_pages;
  d["map_calls"] = s.map_calls;
  d["map_ns_total"] = s.map_ns_total;
  d["map_ns_max"] = s.map_ns_max;
  d["map_failures"] = s.map_failures;
  d["unmap_calls"] = s.unmap_calls;
  d["backoffs"] = s.backoffs;
  d["alloc_timeouts"] = s.alloc_timeouts;
  d["worker_wakeups"] = s.worker_wakeups;
  d["pages_mapped"] = s.pages_mapped;
  d["combined_maps"] = s.combined_maps;
  return d;
}

// ---- fixed allocator handle -----------------------------------------------------------------

struct FixedHandle;
std::mutex g_live_mu;
std::vector<std::weak_ptr<fixed::PageAllocator>>& live_fixed() {
  static auto* v = new std::vector<std::weak_ptr<fixed::PageAllocator>>();
  return *v;
}

struct FixedHandle {
  std::shared_ptr<fixed::PageAllocator> impl;
  explicit FixedHandle(const AllocatorConfig& c) : impl(fixed::PageAllocator::create(c)) {
    std::lock_guard<std::mutex> g(g_live_mu);
    auto& v = live_fixed();
    v.erase(std::remove_if(v.begin(), v.end(), [](auto& w) { return w.expired(); }), v.end());
    v.push_back(impl);
  }
  ~FixedHandle() {
    if (!impl) return;
    // The destructor runs from Python GC with the GIL held: stop without it, so a worker that is
    // inside a Python callback can finish (kvcached #422's join_without_gil).
    if (PyGILState_Check()) {
      nb::gil_scoped_release release;
      impl->stop_prealloc_thread();
    } else {
      impl->stop_prealloc_thread();
    }
    impl.reset();
  }
};

// Stops every live fixed worker at interpreter exit, before threads lose the GIL for good.
void shutdown_all_fixed() {
  std::vector<std::shared_ptr<fixed::PageAllocator>> all;
  {
    std::lock_guard<std::mutex> g(g_live_mu);
    for (auto& w : live_fixed())
      if (auto sp = w.lock()) all.push_back(sp);
  }
  nb::gil_scoped_release release;
  for (auto& a : all) a->stop_prealloc_thread();
  // Objects still alive at exit are never destroyed, so remove device files we were last to use.
  device_exit_cleanup();
}

// ---- device lock handle for Python (simulated co-located VMM activity) ----------------------

struct PyDeviceVmmLock {
  std::unique_ptr<DeviceVmmLock> lock;
  bool held = false;
  explicit PyDeviceVmmLock(const std::string& name) {
    AllocatorConfig probe;
    probe.device_name = name;
    probe.num_layers = probe.mem_size_per_layer = probe.page_size = 4096;
    validate_config(probe);  // reuses the device_name check
    lock = std::make_unique<DeviceVmmLock>(name);
  }
  ~PyDeviceVmmLock() {
    if (held) lock->unlock();
  }
};

}  // namespace bindings
}  // namespace kvdiag

using namespace kvdiag;
using namespace kvdiag::bindings;

static const char* kInitDoc =
    "(num_layers, mem_size_per_layer, page_size, *, world_size=1, pp_rank=0, async_sched=False, "
    "contiguous_layout=True, enable_prealloc=True, num_kv_buffers=2, group_id=0, min_reserved_pages=5, "
    "max_reserved_pages=10, gpu_utilization=0.95, ipc_name='', backend='host', device_name='kvdiag0', "
    "device_size=96 GiB, map_latency_us=0, host_full_commit=False, cuda_device=0, allow_partial_page=False, "
    "print_banner=True, wait_timeout_ms=100, map_timeout_ms=10000, stop_timeout_ms=5000, backoff_ms=5)";

NB_MODULE(_native, m) {
  m.doc() = "kvdiag native page allocators: StockPageAllocator (kvcached fea40de model, deadlock kept) "
            "and FixedPageAllocator (bounded waits, GIL released).";
  nb::set_leak_warnings(false);

  nb::exception<AllocatorTimeout>(m, "AllocatorTimeout", PyExc_RuntimeError);
  nb::exception<BackendUnavailable>(m, "BackendUnavailable", PyExc_RuntimeError);

  // ---- StockPageAllocator: no GIL release anywhere (the defect) ----
  auto stock_cls = nb::class_<stock::PageAllocator>(m, "StockPageAllocator",
                                                    "Model of kvcached's PageAllocator at fea40de. Deadlocks on purpose.");
  stock_cls.attr("kind") = "stock";
  stock_cls
      .def("__init__",
           [](stock::PageAllocator* self, int64_t num_layers, int64_t mem_size_per_layer, int64_t page_size,
              nb::kwargs kw) {
             AllocatorConfig cfg = parse_config(num_layers, mem_size_per_layer, page_size, kw);
             new (self) stock::PageAllocator(cfg);
           },
           "num_layers"_a, "mem_size_per_layer"_a, "page_size"_a, "kwargs"_a, kInitDoc)
      .def("start_prealloc_thread", &stock::PageAllocator::start_prealloc_thread)
      .def("stop_prealloc_thread", &stock::PageAllocator::stop_prealloc_thread)
      .def("alloc_page", &stock::PageAllocator::alloc_page, "Keeps the GIL while it waits (kvcached fea40de).")
      .def("free_page", &stock::PageAllocator::free_page, "page_id"_a)
      .def("free_pages", &stock::PageAllocator::free_pages, "page_ids"_a)
      .def("resize", &stock::PageAllocator::resize, "new_mem_size"_a)
      .def("trim", &stock::PageAllocator::trim)
      .def("trigger_preallocation", &stock::PageAllocator::trigger_preallocation)
      .def("get_num_free_pages", &stock::PageAllocator::get_num_free_pages)
      .def("get_num_inuse_pages", &stock::PageAllocator::get_num_inuse_pages)
      .def("get_num_total_pages", &stock::PageAllocator::get_num_total_pages)
      .def("get_num_reserved_pages", &stock::PageAllocator::get_num_reserved_pages)
      .def("get_num_inflight_pages", &stock::PageAllocator::get_num_inflight_pages)
      .def("get_num_mapped_pages", &stock::PageAllocator::get_num_mapped_pages)
      .def("get_avail_physical_pages", &stock::PageAllocator::get_avail_physical_pages)
      .def("wait_prealloc_idle", &stock::PageAllocator::wait_prealloc_idle, "timeout_s"_a = 10.0,
           nb::call_guard<nb::gil_scoped_release>(), "kvdiag addition: poll until the worker is idle (bounded).")
      .def("set_broadcast_map_callback",
           [](stock::PageAllocator& a, nb::handle cb) { a.set_broadcast_map_callback(make_map_callback(cb)); },
           "callback"_a.none())
      .def("set_broadcast_unmap_callback",
           [](stock::PageAllocator& a, nb::handle cb) { a.set_broadcast_unmap_callback(make_map_callback(cb)); },
           "callback"_a.none())
      .def("set_should_use_worker_ipc_callback",
           [](stock::PageAllocator& a, nb::handle cb) { a.set_should_use_worker_ipc_callback(make_bool_callback(cb)); },
           "callback"_a.none())
      .def("set_use_worker_ipc", &stock::PageAllocator::set_use_worker_ipc, "value"_a)
      .def("counters", [](const stock::PageAllocator& a) { return counters_dict(a.counters()); })
      .def_prop_ro("banner", &stock::PageAllocator::banner)
      .def_prop_ro("min_reserved_pages", &stock::PageAllocator::min_reserved_pages)
      .def_prop_ro("max_reserved_pages", &stock::PageAllocator::max_reserved_pages);

  // ---- FixedPageAllocator: GIL released around everything that can block ----
  using release = nb::call_guard<nb::gil_scoped_release>;
  auto fixed_cls = nb::class_<FixedHandle>(m, "FixedPageAllocator",
                                           "Fixed allocator: bounded waits, in-flight pages visible, GIL released.");
  fixed_cls.attr("kind") = "fixed";
  fixed_cls
      .def("__init__",
           [](FixedHandle* self, int64_t num_layers, int64_t mem_size_per_layer, int64_t page_size, nb::kwargs kw) {
             AllocatorConfig cfg = parse_config(num_layers, mem_size_per_layer, page_size, kw);
             new (self) FixedHandle(cfg);
           },
           "num_layers"_a, "mem_size_per_layer"_a, "page_size"_a, "kwargs"_a, kInitDoc)
      .def("start_prealloc_thread", [](FixedHandle& h) { h.impl->start_prealloc_thread(); }, release())
      .def("stop_prealloc_thread", [](FixedHandle& h) { h.impl->stop_prealloc_thread(); }, release())
      .def("alloc_page",
           [](FixedHandle& h) -> int64_t {
             int64_t id = h.impl->try_alloc_fast();  // never blocks: try_lock + reserved pop
             if (id >= 0) return id;
             nb::gil_scoped_release unlocked;
             return h.impl->alloc_page();
           },
           "Fast path without blocking; otherwise releases the GIL and waits at most map_timeout_ms.")
      .def("free_page",
           [](FixedHandle& h, int64_t page_id) {
             if (h.impl->try_free_fast(page_id)) return;
             nb::gil_scoped_release unlocked;
             h.impl->free_page(page_id);
           },
           "page_id"_a)
      .def("free_pages", [](FixedHandle& h, const std::vector<int64_t>& ids) { h.impl->free_pages(ids); },
           "page_ids"_a, release())
      .def("resize", [](FixedHandle& h, int64_t s) { return h.impl->resize(s); }, "new_mem_size"_a, release())
      .def("trim", [](FixedHandle& h) { h.impl->trim(); }, release())
      .def("trigger_preallocation", [](FixedHandle& h) { h.impl->trigger_preallocation(); }, release())
      .def("get_num_free_pages", [](FixedHandle& h) { return h.impl->get_num_free_pages(); })
      .def("get_num_inuse_pages", [](FixedHandle& h) { return h.impl->get_num_inuse_pages(); })
      .def("get_num_total_pages", [](FixedHandle& h) { return h.impl->get_num_total_pages(); })
      .def("get_num_reserved_pages", [](FixedHandle& h) { return h.impl->get_num_reserved_pages(); })
      .def("get_num_inflight_pages", [](FixedHandle& h) { return h.impl->get_num_inflight_pages(); })
      .def("get_num_mapped_pages", [](FixedHandle& h) { return h.impl->get_num_mapped_pages(); })
      .def("get_avail_physical_pages", [](FixedHandle& h) { return h.impl->get_avail_physical_pages(); }, release())
      .def("wait_prealloc_idle", [](FixedHandle& h, double t) { return h.impl->wait_prealloc_idle(t); },
           "timeout_s"_a = 10.0, release())
      .def("set_broadcast_map_callback",
           [](FixedHandle& h, nb::handle cb) { h.impl->set_broadcast_map_callback(make_map_callback(cb)); },
           "callback"_a.none())
      .def("set_broadcast_unmap_callback",
           [](FixedHandle& h, nb::handle cb) { h.impl->set_broadcast_unmap_callback(make_map_callback(cb)); },
           "callback"_a.none())
      .def("set_should_use_worker_ipc_callback",
           [](FixedHandle& h, nb::handle cb) {
             // Called once here, on the caller's thread; the answer is cached in an atomic.
             h.impl->set_should_use_worker_ipc_callback(make_bool_callback(cb));
           },
           "callback"_a.none())
      .def("set_use_worker_ipc", [](FixedHandle& h, bool v) { h.impl->set_use_worker_ipc(v); }, "value"_a)
      .def("counters", [](FixedHandle& h) { return counters_dict(h.impl->counters()); })
      .def_prop_ro("banner", [](FixedHandle& h) { return h.impl->banner(); })
      .def_prop_ro("min_reserved_pages", [](FixedHandle& h) { return h.impl->min_reserved_pages(); })
      .def_prop_ro("max_reserved_pages", [](FixedHandle& h) { return h.impl->max_reserved_pages(); });

  // ---- device model ----
  m.def("register_device_usage", &register_device_usage, "device_name"_a, "bytes"_a,
        "Register this process's non-KV bytes (e.g. weights) on a modelled host device.");
  m.def("device_used_bytes", &device_used_bytes, "device_name"_a,
        "Bytes in use on a modelled host device by all live processes.");
  m.def("remove_stale_device_files", &remove_stale_device_files, "device_name"_a,
        "Remove a modelled device's /dev/shm files if no live process uses it (e.g. after SIGKILL).");
  m.def("device_lock_path", &device_lock_path, "device_name"_a);
  m.def("device_account_path", &device_account_path, "device_name"_a);

  nb::class_<PyDeviceVmmLock>(m, "DeviceVmmLock", "The cross-process VMM lock of a modelled device.")
      .def(nb::init<const std::string&>(), "device_name"_a)
      .def("acquire",
           [](PyDeviceVmmLock& l, nb::handle timeout_s) {
             if (l.held) throw std::runtime_error("DeviceVmmLock already held by this handle");
             bool ok;
             if (timeout_s.is_none()) {
               nb::gil_scoped_release unlocked;
               l.lock->lock();
               ok = true;
             } else {
               double t = as_float(timeout_s, "timeout_s");
               nb::gil_scoped_release unlocked;
               ok = l.lock->lock_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(std::max(0.0, t))));
             }
             l.held = ok;
             return ok;
           },
           "timeout_s"_a.none() = nb::none())
      .def("release",
           [](PyDeviceVmmLock& l) {
             if (!l.held) throw std::runtime_error("DeviceVmmLock is not held");
             l.lock->unlock();
             l.held = false;
           })
      .def_prop_ro("held", [](PyDeviceVmmLock& l) { return l.held; })
      .def("busy_elsewhere", [](PyDeviceVmmLock& l) { return l.lock->busy_elsewhere(); });

  // ---- native stress loop (benchmarks and tests) ----
  m.def(
      "stress",
      [](const std::string& kind, int threads, int64_t ops, const std::string& mode, uint64_t seed, int64_t stall_ms,
         int64_t hold_max, bool start_prealloc, int64_t num_layers, int64_t mem_size_per_layer, int64_t page_size,
         nb::kwargs kw) {
        StressOptions o;
        o.kind = kind;
        o.threads = threads;
        o.ops = ops;
        o.mode = mode;
        o.seed = seed;
        o.stall_ms = stall_ms;
        o.hold_max = hold_max;
        o.start_prealloc = start_prealloc;
        o.cfg = parse_config(num_layers, mem_size_per_layer, page_size, kw);
        StressResult r;
        {
          nb::gil_scoped_release unlocked;
          r = run_stress(o);
        }
        nb::dict d;
        d["ops"] = r.ops;
        d["elapsed_ns"] = r.elapsed_ns;
        d["max_op_ns"] = r.max_op_ns;
        d["stalls"] = r.stalls;
        d["allocs"] = r.allocs;
        d["frees"] = r.frees;
        d["out_of_pages"] = r.out_of_pages;
        d["timeouts"] = r.timeouts;
        d["errors"] = r.errors;
        d["double_allocs"] = r.double_allocs;
        d["resizes_ok"] = r.resizes_ok;
        d["final_free"] = r.final_free;
        d["final_total"] = r.final_total;
        d["final_inflight"] = r.final_inflight;
        d["first_error"] = r.first_error;
        d["counters"] = counters_dict(r.counters);
        return d;
      },
      "kind"_a = "fixed", "threads"_a = 4, "ops"_a = 1000000, "mode"_a = "random", "seed"_a = 1, "stall_ms"_a = 100,
      "hold_max"_a = 8, "start_prealloc"_a = true, "num_layers"_a = 4, "mem_size_per_layer"_a = 64 * 65536,
      "page_size"_a = 65536, "kwargs"_a,
      "Run a native multi-threaded stress loop (GIL released) and return its statistics.");

  m.def(
      "build_info",
      [] {
        nb::dict d;
        d["stock"] = stock::build_info();
        d["fixed"] = fixed::build_info();
        d["bindings"] = KVDIAG_BUILD_INFO;
        return d;
      },
      "How each part of this extension was compiled (CMake build type, flags, optimization).");

  m.def("_shutdown_all", &shutdown_all_fixed,
        "At exit: stop every live fixed allocator's worker and drop device files we were last to use.");
  nb::module_::import_("atexit").attr("register")(m.attr("_shutdown_all"));
}
