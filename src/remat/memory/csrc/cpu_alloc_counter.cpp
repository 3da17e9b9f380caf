// remat's CPU allocator counter (NOTE [CPU allocator counter] in remat/memory/allocator.py).
//
// Wraps the process's CPU allocator (c10::GetCPUAllocator(), the one at::empty uses) and counts
// the bytes of every allocation made while a *window* is open, less those of the same window's
// allocations freed before it closes. Inside a window: one mutex-guarded map insert and erase per
// allocation, in C++ (no Python runs per op, so a measured step costs what the step costs).
// Outside a window an allocation is the wrapped allocator's own, untouched, after one atomic load.
//
// Kept deliberately small: the DataPtr's context stays equal to its data pointer (as the
// default CPU allocator's is), so raw_allocate / raw_deallocate keep working, and the wrapped
// allocator's own deleter frees the memory.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {

struct Counter {
  std::mutex mu;
  std::unordered_map<void*, std::pair<size_t, uint64_t>> sizes;  // data -> (bytes, window)
  std::atomic<uint64_t> window{0};  // the open window's number; 0: closed (read without the mutex)
  uint64_t last_window = 0;
  int64_t live = 0;        // bytes allocated in the open window and not yet freed
  int64_t peak = 0;        // max of live since the window opened or the peak was last reset
  int64_t allocations = 0; // allocations counted in the open window
  int64_t allocated = 0;   // bytes allocated in the open window, frees not subtracted
};

Counter& counter() {
  static Counter* c = new Counter();  // never destroyed: deleters may run at interpreter exit
  return *c;
}

c10::Allocator* g_inner = nullptr;
c10::DeleterFnPtr g_inner_delete = nullptr;

void counting_delete(void* ptr) {
  if (ptr != nullptr) {
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    auto it = c.sizes.find(ptr);
    if (it != c.sizes.end()) {
      uint64_t open = c.window.load();
      if (open != 0 && it->second.second == open) {
        c.live -= static_cast<int64_t>(it->second.first);
      }
      c.sizes.erase(it);
    }
  }
  g_inner_delete(ptr);
}

struct CountingAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (counter().window.load(std::memory_order_relaxed) == 0) {
      return g_inner->allocate(nbytes);  // no window open: the wrapped allocator's own allocation
    }
    c10::DataPtr dp = g_inner->allocate(nbytes);
    void* data = dp.get();
    if (data == nullptr || dp.get_context() != data || dp.get_deleter() != g_inner_delete) {
      return dp;  // not the plain allocation this counter understands: left uncounted
    }
    {
      Counter& c = counter();
      std::lock_guard<std::mutex> guard(c.mu);
      uint64_t open = c.window.load();
      if (open == 0) {
        return dp;  // the window closed meanwhile: not counted, not tracked
      }
      c.sizes[data] = {nbytes, open};
      c.live += static_cast<int64_t>(nbytes);
      c.allocations += 1;
      c.allocated += static_cast<int64_t>(nbytes);
      if (c.live > c.peak) c.peak = c.live;
    }
    dp.release_context();
    return c10::DataPtr(data, data, &counting_delete, dp.device());
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator* g_alloc = nullptr;

bool installed() { return g_alloc != nullptr && c10::GetCPUAllocator() == g_alloc; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", []() {
    if (g_alloc == nullptr) {
      c10::Allocator* inner = c10::GetCPUAllocator();
      if (inner->raw_deleter() == nullptr) return false;  // an allocator without a plain deleter
      g_inner = inner;
      g_inner_delete = inner->raw_deleter();
      g_alloc = new CountingAllocator();  // never freed: tensors keep its deleter
      c10::SetCPUAllocator(g_alloc, /*priority=*/100);
    }
    return installed();
  });
  m.def("installed", &installed);
  // A storage made before install() holds the wrapped allocator itself, and resizing it (what
  // UntypedStorage.resize_ does: StorageImpl::allocator()->allocate) would bypass the counter:
  // point it at the counter instead (NOTE [storage resizes] in remat/memory/resize.py). `impl` is
  // the StorageImpl's address (UntypedStorage._cdata), kept alive by the caller. False: not the
  // wrapped allocator's storage (already the counter's, or another allocator's), left as it is.
  m.def("adopt", [](uintptr_t impl) {
    auto* storage = reinterpret_cast<c10::StorageImpl*>(impl);
    if (!installed() || storage == nullptr || storage->allocator() != g_inner) return false;
    storage->set_allocator(g_alloc);
    return true;
  });
  m.def("open_window", []() {
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    c.window.store(++c.last_window);
    c.live = c.peak = c.allocations = c.allocated = 0;
  });
  m.def("close_window", []() {
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    c.window.store(0);
  });
  m.def("live", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.live; });
  m.def("peak", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.peak; });
  m.def("allocations", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.allocations; });
  m.def("allocated", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.allocated; });
  m.def("reset_peak", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); c.peak = c.live; });
}
