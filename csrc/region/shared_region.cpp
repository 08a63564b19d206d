#include "shared_region.h"

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backends/backend.h"
#ifdef OFFCACHE_WITH_CUDA
#include "backends/cuda_pinned.h"
#endif

namespace offcache {
namespace {

std::mutex g_mu;  // the figures below and the dead mappings; never held while waiting
SharedStats g_stats;
std::vector<SharedSpan*> g_dead;      // mappings whose storage died while copies still read them
std::atomic<size_t> g_dead_count{0};  // g_dead.size(), read without g_mu (reap_shared)
size_t g_chunk = kRegisterChunk;
int g_fail_after = -1;  // tests: the chunk whose registration fails next (-1: none)
std::string g_fail_reason;

// Whether chunk `index` of this registration is to fail (tests), and why.
bool injected(size_t index, std::string* reason) {
  const char* env = std::getenv("OFFCACHE_FAIL_REGISTER");
  if (env != nullptr && *env != '\0') {
    *reason = std::string("injected registration failure (OFFCACHE_FAIL_REGISTER): ") + env;
    return true;
  }
  std::lock_guard<std::mutex> l(g_mu);
  if (g_fail_after < 0 || static_cast<size_t>(g_fail_after) != index) return false;
  *reason = "injected registration failure (tests): " + g_fail_reason;
  g_fail_after = -1;
  return true;
}

// Unregisters every chunk of `s` (CUDA, in its own process); false if one stays registered.
bool unregister_all(SharedSpan* s) noexcept {
  bool ok = true;
#ifdef OFFCACHE_WITH_CUDA
  if (s->cuda && s->owner_pid == getpid()) {
    for (const auto& chunk : s->chunks) {
      std::string error;
      if (!cuda_unregister_host(chunk.first, s->device, &error)) {
        ok = false;
        std::lock_guard<std::mutex> l(g_mu);
        ++g_stats.unregister_failures;
        std::fprintf(stderr, "offcache: %s; the shared mapping stays mapped\n", error.c_str());
      }
    }
  }
#endif
  s->chunks.clear();
  return ok;
}

// Unregisters and unmaps a span no tensor views and no copy reads.
void destroy(SharedSpan* s) noexcept {
  const bool registered = s->registered;
  const bool unmap = unregister_all(s);
  {
    std::lock_guard<std::mutex> l(g_mu);
    g_stats.mapped_bytes -= s->bytes;
    --g_stats.mappings;
    if (registered) g_stats.registered_bytes -= s->bytes;
    g_stats.pinned_share_bytes -= s->share;
  }
  // Memory the driver may still have registered is never unmapped under it.
  if (unmap) (void)munmap(s->base, s->bytes);
  delete s;
}

bool quiet(SharedSpan* s) noexcept {
  try {
    return s->pending().empty();
  } catch (...) {  // no memory to copy the list: keep it for later
    return false;
  }
}

// Destroys the dead mappings whose copies completed.
void reap() {
  std::vector<SharedSpan*> done;
  {
    std::lock_guard<std::mutex> l(g_mu);
    if (g_dead.empty()) return;
    auto it = std::partition(g_dead.begin(), g_dead.end(), [](SharedSpan* s) { return !quiet(s); });
    done.assign(it, g_dead.end());
    g_dead.erase(it, g_dead.end());
    g_stats.deferred_unmaps = g_dead.size();
    g_dead_count.store(g_dead.size(), std::memory_order_relaxed);
  }
  for (SharedSpan* s : done) destroy(s);
}

// The storage deleter: at once when no copy reads the span, else at a later reap().
void delete_span(void* ctx) {
  auto* s = static_cast<SharedSpan*>(ctx);
  if (quiet(s)) return destroy(s);
  try {
    std::lock_guard<std::mutex> l(g_mu);
    g_dead.push_back(s);
    g_stats.deferred_unmaps = g_dead.size();
    g_dead_count.store(g_dead.size(), std::memory_order_relaxed);
  } catch (...) {  // no memory to list it: it stays mapped (and registered) for good
  }
}

}  // namespace

// Completed fences are dropped as a host block's are (HostBlock::add_fence): through
// Backend::probe (the tests' fault hook, uncounted: the span is no engine's) and drop_completed,
// which asks every query before it moves anything. A query that throws (refused for now during a
// capture elsewhere, or for good on a broken context) keeps every fence: none is lost, none left
// empty (std::remove_if left moved-from, null fences behind, and the next prune crashed on one).
void SharedSpan::drop_completed_locked() noexcept {
  try {
    drop_completed(&fences, [](const EventPtr& e) { return Backend::probe(e); });
  } catch (...) {  // NOLINT(bugprone-empty-catch): all kept, as above
  }
}

void SharedSpan::add_fence(const EventPtr& event) {
  std::lock_guard<std::mutex> l(mu);
  if (std::find(fences.begin(), fences.end(), event) != fences.end()) return;
  if (fences.size() >= 4) drop_completed_locked();
  fences.push_back(event);  // its copy was issued, whatever the queries did
}

std::vector<EventPtr> SharedSpan::pending() {
  std::lock_guard<std::mutex> l(mu);
  drop_completed_locked();
  return fences;
}

SharedMapping map_shared(int fd, size_t offset, size_t bytes, size_t ranks, bool cuda, int device,
                         size_t budget) {
  TORCH_CHECK_VALUE(bytes > 0, "offcache: map_shared of 0 bytes");
  TORCH_CHECK_VALUE(ranks > 0, "offcache: map_shared for ", ranks, " ranks");
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  TORCH_CHECK_VALUE(offset % page == 0 && bytes % page == 0, "offcache: map_shared of ", bytes,
                    " bytes at ", offset, ": both must be multiples of the page size ", page);
  reap();
  void* p =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  TORCH_CHECK(p != MAP_FAILED, "offcache: mmap of ", bytes, " bytes at offset ", offset, " of fd ",
              fd, " failed: ", std::strerror(errno));
  auto* s = new SharedSpan();
  s->base = static_cast<char*>(p);
  s->bytes = bytes;
  s->cuda = cuda;
  s->device = device;
  s->owner_pid = getpid();
  std::string reason;
  const size_t share = (bytes + ranks - 1) / ranks;
  {
    std::lock_guard<std::mutex> l(g_mu);
    if (g_stats.pinned_share_bytes + share > budget) {
      reason = "its share of " + std::to_string(share) + " bytes would take this process past " +
               "its pinned budget of " + std::to_string(budget) + " bytes (" +
               std::to_string(g_stats.pinned_share_bytes) + " taken by the region already)";
    } else {
      g_stats.pinned_share_bytes += share;  // held while registering: racing maps see it
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  size_t made = 0;
  if (reason.empty()) {
    size_t chunk;
    {
      std::lock_guard<std::mutex> l(g_mu);
      chunk = g_chunk;
    }
    for (size_t at = 0; at < bytes && reason.empty(); at += chunk, ++made) {
      const size_t n = std::min(chunk, bytes - at);
      if (injected(made, &reason)) break;
#ifdef OFFCACHE_WITH_CUDA
      if (cuda && !cuda_register_host(s->base + at, n, s->device, &reason)) break;
#endif
      s->chunks.emplace_back(s->base + at, n);
    }
    if (!reason.empty()) {
      unregister_all(s);  // the chunks made before the failure
      std::lock_guard<std::mutex> l(g_mu);
      g_stats.pinned_share_bytes -= share;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s->registered = reason.empty();
  s->share = s->registered ? share : 0;
  {
    std::lock_guard<std::mutex> l(g_mu);
    g_stats.mapped_bytes += bytes;
    ++g_stats.mappings;
    g_stats.registrations += made;  // chunks registered, undone ones included
    g_stats.register_seconds += seconds;
    if (s->registered) {
      g_stats.registered_bytes += bytes;
    } else {
      ++g_stats.register_failures;
    }
  }
  c10::DataPtr data(s->base, s, &delete_span, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                       /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  t.set_(storage, 0, {static_cast<int64_t>(bytes)}, {1});
  return {t, reason};
}

SharedSpan* shared_span_of(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.has_storage()) return nullptr;
  const c10::DataPtr& data = t.storage().data_ptr();
  if (data.get_deleter() != &delete_span) return nullptr;
  return static_cast<SharedSpan*>(data.get_context());
}

void reap_shared() {
  if (g_dead_count.load(std::memory_order_relaxed) > 0) reap();
}

void wait_shared_reads(const at::Tensor& t) {
  if (SharedSpan* s = shared_span_of(t)) {
    for (const EventPtr& e : s->pending()) e->wait();
  }
  reap();
}

uint64_t shared_word_add(const at::Tensor& word, uint64_t delta) {
  TORCH_CHECK_VALUE(
      word.defined() && word.device().is_cpu() && word.is_contiguous() && word.nbytes() == 8,
      "offcache: a generation word is 8 contiguous bytes on the CPU, got ",
      word.defined() ? word.nbytes() : 0, " bytes");
  auto* p = static_cast<uint64_t*>(word.data_ptr());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(p) % 8 == 0,
                    "offcache: a generation word must be 8-byte aligned");
  return __atomic_add_fetch(p, delta, __ATOMIC_SEQ_CST);
}

SharedStats shared_stats() {
  reap();
  std::lock_guard<std::mutex> l(g_mu);
  return g_stats;
}

size_t shared_pinned_share() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_stats.pinned_share_bytes;
}

void note_shared_fetch(size_t bytes, bool pinned) {
  std::lock_guard<std::mutex> l(g_mu);
  ++g_stats.fetches;
  g_stats.fetch_bytes += bytes;
  if (pinned) g_stats.pinned_fetch_bytes += bytes;
}

void fail_register(int after, const std::string& reason) {
  std::lock_guard<std::mutex> l(g_mu);
  g_fail_after = after;
  g_fail_reason = reason;
}

void set_register_chunk(size_t chunk) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  TORCH_CHECK_VALUE(chunk == 0 || chunk % page == 0,
                    "offcache: a registration chunk must be a multiple of the page size ", page,
                    ", got ", chunk);
  std::lock_guard<std::mutex> l(g_mu);
  g_chunk = chunk == 0 ? kRegisterChunk : chunk;
}

}  // namespace offcache
