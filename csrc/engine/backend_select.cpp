// The one place the backend is chosen, and the process's engines: the
// current one, and retired ones that still serve tensors they stored.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <thread>

#include "backends/backend_host.h"
#include "engine.h"

namespace offcache {

#ifdef OFFCACHE_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int64_t host_copy_delay_us);
int cuda_device_count();
#endif

bool cuda_compiled() {
#ifdef OFFCACHE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

enum class Choice { kAuto, kCuda, kHost };

// Set by configure_global_engine() (the Python layer always configures at
// import, with the defaults written in offcache/engine/config.py, DEFAULTS).
struct Config {
  Choice backend = Choice::kAuto;
  size_t pinned_limit = 0;
  size_t min_chunk = 0;
  size_t max_in_flight = 0;
  int64_t host_copy_delay_us = 0;
  DiskOptions disk;
};

std::unique_ptr<Backend> choose(const Config& c) {
  if (c.backend == Choice::kHost) return std::make_unique<HostBackend>(c.host_copy_delay_us);
#ifdef OFFCACHE_WITH_CUDA
  if (cuda_device_count() > 0) return make_cuda_backend(c.host_copy_delay_us);
#endif
  TORCH_CHECK(c.backend != Choice::kCuda, "offcache: OFFCACHE_BACKEND=cuda, but ",
              cuda_compiled() ? "no CUDA device is visible" : "offcache was built without CUDA");
  return std::make_unique<HostBackend>(c.host_copy_delay_us);
}

std::mutex g_mu;
Config g_config;
bool g_configured = false;
Engine* g_engine = nullptr;
RetiredSet<Engine> g_retired;  // replaced engines that still own blocks or serve calls
std::once_flag g_atfork_once;

// fork(): no engine lock may be held by another thread at that moment, or the
// child would wait on it forever. (Host copy streams drain themselves.)
std::vector<Engine*> g_forking;  // the retired engines locked across fork()
void before_fork() {
  g_mu.lock();
  if (g_engine) g_engine->lock_for_fork();
  g_forking = g_retired.lock_for_fork();  // none is deleted until after fork()
  for (Engine* e : g_forking) e->lock_for_fork();
}
void after_fork() {
  for (Engine* e : g_forking) e->unlock_after_fork();
  g_retired.unlock_after_fork();
  if (g_engine) g_engine->unlock_after_fork();
  g_mu.unlock();
}

}  // namespace

namespace {

Engine& global_engine_locked() {
  TORCH_INTERNAL_ASSERT(g_configured, "offcache: the engine is used before offcache.configure()");
  if (g_engine == nullptr) {
    std::call_once(g_atfork_once, [] { pthread_atfork(&before_fork, &after_fork, &after_fork); });
    ArenaOptions arena;
    arena.min_chunk = g_config.min_chunk;
    arena.limit = g_config.pinned_limit;
    g_engine = new Engine(choose(g_config), arena, g_config.max_in_flight, g_config.disk);
  }
  return *g_engine;
}

}  // namespace

EngineUse::EngineUse() {
  {
    std::lock_guard<std::mutex> lock(g_mu);  // configure() retires under g_mu: enter first
    engine_ = &global_engine_locked();
    engine_->enter();
  }
  try {
    scope_ = engine_->backend().enter_call();
  } catch (...) {
    engine_->leave();
    throw;
  }
}

void configure_global_engine(const std::string& backend, size_t pinned_limit, size_t min_chunk,
                             size_t max_in_flight, int64_t host_copy_delay_us,
                             const std::string& disk_dir, size_t host_limit) {
  Choice choice;
  if (backend == "auto") {
    choice = Choice::kAuto;
  } else if (backend == "cuda") {
    choice = Choice::kCuda;
  } else if (backend == "host") {
    choice = Choice::kHost;
  } else {
    TORCH_CHECK_VALUE(
        false, "offcache: backend (OFFCACHE_BACKEND) must be 'auto', 'cuda' or 'host', got '",
        backend, "'");
  }
  TORCH_CHECK_VALUE(min_chunk > 0 && min_chunk <= ArenaOptions{}.max_chunk,
                    "offcache: the smallest chunk (OFFCACHE_CHUNK_BYTES) must be in [1, ",
                    ArenaOptions{}.max_chunk, "] bytes, got ", min_chunk);
  TORCH_CHECK_VALUE(host_copy_delay_us >= 0,
                    "offcache: OFFCACHE_HOST_COPY_DELAY_US must be >= 0, got ", host_copy_delay_us);
#ifdef OFFCACHE_WITH_CUDA
  const bool cuda_visible = cuda_device_count() > 0;
#else
  const bool cuda_visible = false;
#endif
  // Refused now, not at first use: the working engine stays.
  TORCH_CHECK(choice != Choice::kCuda || cuda_visible, "offcache: OFFCACHE_BACKEND=cuda, but ",
              cuda_compiled() ? "no CUDA device is visible" : "offcache was built without CUDA");
  Engine* old = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_config = Config{choice,        pinned_limit,       min_chunk,
                      max_in_flight, host_copy_delay_us, DiskOptions{disk_dir, host_limit}};
    g_configured = true;
    old = std::exchange(g_engine, nullptr);  // the next use builds a new one, lazily
  }
  if (old == nullptr) return;
  // The old engine serves the tensors it still owns, then goes.
  try {
    old->empty_cache();
  } catch (const std::exception&) {  // its stream failed (raised to its users): it retires anyway
  }
  if (g_retired.retire(old)) delete old;
}

void delete_retired(Engine* engine) {
  // The caller saw the engine idle, but synchronize_all() may have entered it
  // since (its leave() deletes it then), or another caller took it already.
  if (g_retired.take_if_idle(engine) == nullptr) return;
  // Off the calling thread: it may be one of the engine's own copy-stream
  // workers (a tensor dying in a task), which the destructor joins.
  std::thread([engine] {
    try {
      engine->prepare_thread();  // its device selected before the streams and chunks go
    } catch (const std::exception& e) {
      std::fprintf(stderr, "offcache: retiring an engine: %s\n", e.what());
    }
    delete engine;
  }).detach();
}

void synchronize_all() {
  std::vector<Engine*> engines;
  Engine* current;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    current = g_engine;
    if (g_engine) {
      g_engine->enter();
      engines.push_back(g_engine);
    }
  }
  // Each is entered: none is deleted while we wait on it.
  const std::vector<Engine*> retired = g_retired.enter_all();
  engines.insert(engines.end(), retired.begin(), retired.end());
  struct Leave {
    std::vector<Engine*>& engines;
    ~Leave() {
      for (Engine* e : engines) e->leave();
    }
  } leave{engines};
  // A retired engine's stream error was the current engine's once: raised then.
  for (Engine* e : engines) e->synchronize(/*check=*/e == current);
}

std::pair<size_t, size_t> retired_engines() {
  // Under the set's lock: a retired engine is deleted only after it left the set.
  size_t reserved = 0, count = 0;
  // reserved_bytes(), not stats(): stats() reaps, and a tensor dying here
  // could delete its retired engine, which takes the set's lock.
  g_retired.for_each([&](Engine* e) {
    reserved += e->reserved_bytes();
    ++count;
  });
  return {count, reserved};
}

}  // namespace offcache
