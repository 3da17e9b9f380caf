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

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

namespace {

// A capacity ledger (NOTE [CPU device capacity] in remat/memory/capacity.py): the bytes charged
// to it (a base the caller states, plus every allocation made while it is the active ledger, less
// those freed), and the limit past which an allocation raises c10::OutOfMemoryError, which Python
// sees as torch.OutOfMemoryError, as the CUDA caching allocator raises it.
struct Ledger {
  int64_t limit = 0;
  int64_t live = 0;
  int64_t peak = 0;
  int64_t failed_request = -1;  // the refused allocation's bytes (-1: none refused)
  int64_t failed_live = 0;      // live bytes when it was refused
};

struct Entry {
  size_t bytes;
  uint64_t window;  // the window that counts it (0: none)
  uint64_t ledger;  // the ledger charged for it (0: none)
};

struct Counter {
  std::mutex mu;
  std::unordered_map<void*, Entry> sizes;  // data -> its entry
  std::unordered_map<uint64_t, Ledger> ledgers;  // open ledgers by number
  std::atomic<uint64_t> active{0};  // the ledger new allocations are charged to (0: none)
  uint64_t last_ledger = 0;
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
      if (open != 0 && it->second.window == open) {
        c.live -= static_cast<int64_t>(it->second.bytes);
      }
      auto ledger = c.ledgers.find(it->second.ledger);
      if (ledger != c.ledgers.end()) {
        ledger->second.live -= static_cast<int64_t>(it->second.bytes);
      }
      c.sizes.erase(it);
    }
  }
  g_inner_delete(ptr);
}

std::string fmt_mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// Raises c10::OutOfMemoryError when the active ledger cannot take ``nbytes`` more, recording the
// refusal on the ledger first (the caller reads it back as the blocked step's evidence).
void refuse_over_capacity(size_t nbytes) {
  Counter& c = counter();
  int64_t limit = 0, live = 0;
  {
    std::lock_guard<std::mutex> guard(c.mu);
    auto ledger = c.ledgers.find(c.active.load());
    if (ledger == c.ledgers.end()) return;
    Ledger& l = ledger->second;
    if (l.live + static_cast<int64_t>(nbytes) <= l.limit) return;
    l.failed_request = static_cast<int64_t>(nbytes);
    l.failed_live = l.live;
    limit = l.limit;
    live = l.live;
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false,
                   "CPU out of memory (remat device capacity). Tried to allocate ", fmt_mib(nbytes), "; ",
                   fmt_mib(live), " of the stated capacity of ", fmt_mib(limit), " already in use.");
}

struct CountingAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (counter().window.load(std::memory_order_relaxed) == 0 &&
        counter().active.load(std::memory_order_relaxed) == 0) {
      return g_inner->allocate(nbytes);  // no window, no ledger: the wrapped allocator's own allocation
    }
    refuse_over_capacity(nbytes);
    c10::DataPtr dp = g_inner->allocate(nbytes);
    void* data = dp.get();
    if (data == nullptr || dp.get_context() != data || dp.get_deleter() != g_inner_delete) {
      return dp;  // not the plain allocation this counter understands: left uncounted
    }
    {
      Counter& c = counter();
      std::lock_guard<std::mutex> guard(c.mu);
      uint64_t open = c.window.load();
      uint64_t charged = c.active.load();
      auto ledger = c.ledgers.find(charged);
      if (ledger == c.ledgers.end()) charged = 0;
      if (open == 0 && charged == 0) {
        return dp;  // the window closed meanwhile: not counted, not tracked
      }
      c.sizes[data] = {nbytes, open, charged};
      if (open != 0) {
        c.live += static_cast<int64_t>(nbytes);
        c.allocations += 1;
        c.allocated += static_cast<int64_t>(nbytes);
        if (c.live > c.peak) c.peak = c.live;
      }
      if (charged != 0) {
        Ledger& l = ledger->second;
        l.live += static_cast<int64_t>(nbytes);
        if (l.live > l.peak) l.peak = l.live;
      }
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
  // Ledgers (NOTE [CPU device capacity]): open one with a limit and the bytes already charged to
  // it (state live before it opened); activate it to charge and check new allocations against it.
  m.def("ledger_open", [](int64_t limit, int64_t base) {
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    uint64_t n = ++c.last_ledger;
    Ledger& l = c.ledgers[n];
    l.limit = limit;
    l.live = l.peak = base;
    return n;
  });
  m.def("ledger_activate", [](uint64_t n) {  // 0: none; returns the ledger active before
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    if (n != 0 && c.ledgers.find(n) == c.ledgers.end()) n = 0;
    return c.active.exchange(n);
  });
  m.def("ledger_close", [](uint64_t n) {
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    if (c.active.load() == n) c.active.store(0);
    c.ledgers.erase(n);
    for (auto& kv : c.sizes) {
      if (kv.second.ledger == n) kv.second.ledger = 0;
    }
  });
  m.def("ledger_state", [](uint64_t n) {  // (limit, live, peak, failed request or -1, live at the refusal)
    Counter& c = counter();
    std::lock_guard<std::mutex> guard(c.mu);
    auto it = c.ledgers.find(n);
    if (it == c.ledgers.end()) return std::make_tuple<int64_t, int64_t, int64_t, int64_t, int64_t>(0, 0, 0, -1, 0);
    const Ledger& l = it->second;
    return std::make_tuple(l.limit, l.live, l.peak, l.failed_request, l.failed_live);
  });
  m.def("live", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.live; });
  m.def("peak", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.peak; });
  m.def("allocations", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.allocations; });
  m.def("allocated", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); return c.allocated; });
  m.def("reset_peak", []() { Counter& c = counter(); std::lock_guard<std::mutex> g(c.mu); c.peak = c.live; });
}
