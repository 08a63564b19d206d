#include "cuda_pinned.h"

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <utility>

namespace offcache {
namespace {

// Fork. A child cannot use the parent's CUDA context, events or registrations,
// and its pinned pages are wiped (MADV_WIPEONFORK): reading a stored tensor
// there would silently give zeros. So the child's copies of every pinned chunk
// become PROT_NONE (a read faults), and every CUDA backend learns it is in a
// child from a generation counter (no getpid() per call).
std::mutex g_pinned_mu;
std::set<std::pair<void*, size_t>>& pinned_chunks() {
  static auto* chunks = new std::set<std::pair<void*, size_t>>();  // never destroyed: atfork
  return *chunks;
}
std::atomic<uint64_t> g_fork_generation{0};

void pinned_before_fork() { g_pinned_mu.lock(); }
void pinned_after_fork_parent() { g_pinned_mu.unlock(); }
void pinned_after_fork_child() {
  for (const auto& [ptr, bytes] : pinned_chunks()) (void)mprotect(ptr, bytes, PROT_NONE);
  g_fork_generation.fetch_add(1);
  g_pinned_mu.unlock();
}
// Registered when the library loads, before any engine or host stream: its
// prepare handler then runs last, after the streams drained and the engines'
// locks were taken (a release holds an engine lock, then g_pinned_mu).
const int g_fork_handlers =
    pthread_atfork(&pinned_before_fork, &pinned_after_fork_parent, &pinned_after_fork_child);

}  // namespace

uint64_t fork_generation() {
  (void)g_fork_handlers;
  return g_fork_generation.load();
}

PinnedCallScope::PinnedCallScope(int device) noexcept {
  if (device >= 0) {
    try {
      guard_.emplace(static_cast<c10::DeviceIndex>(device));
    } catch (...) {  // cudaSetDevice failed: the call goes on where the thread is
      device_ok_ = false;
      (void)cudaGetLastError();
    }
  }
  relaxed_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
  if (!relaxed_) (void)cudaGetLastError();
}

PinnedCallScope::~PinnedCallScope() {
  if (relaxed_ && cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess)
    (void)cudaGetLastError();
  // guard_ restores the thread's device last, without making a context for it (c10).
}

// offcache.weights.node's shared mappings (csrc/region/): registered on `device` in relaxed
// capture mode, as the arena's chunks are, every return code checked.
bool cuda_register_host(void* ptr, size_t bytes, int device, std::string* error) {
  cudaError_t err;
  {
    PinnedCallScope scope(device);
    if (!scope.device_ok()) {
      *error = "cudaSetDevice(" + std::to_string(device) + ") failed before cudaHostRegister";
      return false;
    }
    err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  }
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  *error = std::string("cudaHostRegister of ") + std::to_string(bytes) +
           " bytes failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  return false;
}

bool cuda_unregister_host(void* ptr, int device, std::string* error) noexcept {
  cudaError_t err;
  {
    PinnedCallScope scope(device);
    err = cudaHostUnregister(ptr);
  }
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  try {
    *error = std::string("cudaHostUnregister failed: ") + cudaGetErrorName(err) + ": " +
             cudaGetErrorString(err);
  } catch (...) {  // NOLINT(bugprone-empty-catch): no memory for the message
  }
  return false;
}

PinnedSource::PinnedSource(Counters& counters, std::function<int()> device)
    : counters_(counters), device_(std::move(device)), pages_(/*wipe_on_fork=*/true) {
  (void)g_fork_handlers;
}

void* PinnedSource::allocate(size_t bytes, std::string* error) {
  void* p = pages_.allocate(bytes, error);
  if (p == nullptr) return nullptr;
  ++counters_.pinned_registrations;
  cudaError_t err = cudaErrorInvalidDevice;
  {
    PinnedCallScope scope(device_());
    if (scope.device_ok()) err = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    pages_.release(p, bytes);
    if (error) {
      *error = std::string("cudaHostRegister of ") + std::to_string(bytes) +
               " bytes failed: " + cudaGetErrorString(err);
    }
    return nullptr;
  }
  try {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    pinned_chunks().emplace(p, bytes);
  } catch (const std::exception&) {               // no memory for the entry: no chunk either
    if (unregister(p)) pages_.release(p, bytes);  // else kept mapped: see release()
    if (error) *error = "out of memory registering a pinned chunk";
    return nullptr;
  }
  return p;
}

void PinnedSource::release(void* ptr, size_t bytes) noexcept {
  // A chunk that stays registered stays mapped (and listed for fork): memory
  // the driver still has registered is never unmapped under it.
  if (!unregister(ptr)) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    pinned_chunks().erase({ptr, bytes});
  }
  pages_.release(ptr, bytes);
}

bool PinnedSource::unregister(void* ptr) noexcept {
  cudaError_t err;
  {
    PinnedCallScope scope(device_());
    err = cudaHostUnregister(ptr);
  }
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  ++counters_.chunks_kept_registered;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    std::fprintf(stderr,
                 "offcache: cudaHostUnregister failed (%s); the pinned chunk is kept mapped "
                 "instead of being returned to the OS (stats()[\"chunks_kept_registered\"] "
                 "counts them; this warning is printed once)\n",
                 cudaGetErrorString(err));
  }
  return false;
}

}  // namespace offcache
