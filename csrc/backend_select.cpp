// The one place the backend is chosen, and the process-wide engine.
#include <unistd.h>

#include <mutex>

#include "backend_host.h"
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

struct Config {
  std::string backend = "auto";
  size_t pinned_limit = SIZE_MAX;
  size_t min_chunk = size_t{2} << 20;
  size_t max_in_flight = size_t{1} << 30;
  int64_t host_copy_delay_us = 0;
};

std::unique_ptr<Backend> choose(const Config& c) {
  // c.backend was validated by configure_global_engine().
  if (c.backend == "host") return std::make_unique<HostBackend>(c.host_copy_delay_us);
#ifdef OFFCACHE_WITH_CUDA
  if (cuda_device_count() > 0) return make_cuda_backend(c.host_copy_delay_us);
#endif
  TORCH_CHECK(c.backend != "cuda", "offcache: OFFCACHE_BACKEND=cuda, but ",
              cuda_compiled() ? "no CUDA device is visible" : "offcache was built without CUDA");
  return std::make_unique<HostBackend>(c.host_copy_delay_us);
}

std::mutex g_mu;
Config g_config;
// Engines are never destroyed: stored tensors may outlive a reconfiguration
// or be freed during interpreter shutdown, and their deleters need the
// engine that made them.
Engine* g_engine = nullptr;
pid_t g_pid = 0;

}  // namespace

Engine& global_engine() {
  std::lock_guard<std::mutex> lock(g_mu);
  // The host backend's worker threads do not survive fork(): a child gets a
  // fresh engine. The CUDA backend refuses to work in a child instead.
  if (g_engine != nullptr && g_pid != getpid() && g_engine->backend().name() == "host") {
    g_engine = nullptr;
  }
  if (g_engine == nullptr) {
    ArenaOptions arena;
    arena.min_chunk = g_config.min_chunk;
    arena.limit = g_config.pinned_limit;
    g_engine = new Engine(choose(g_config), arena, g_config.max_in_flight);
    g_pid = getpid();
  }
  return *g_engine;
}

bool global_engine_created() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_engine != nullptr;
}

void configure_global_engine(const std::string& backend, size_t pinned_limit, size_t min_chunk,
                             size_t max_in_flight, int64_t host_copy_delay_us) {
  TORCH_CHECK_VALUE(backend == "auto" || backend == "cuda" || backend == "host",
                    "offcache: backend (OFFCACHE_BACKEND) must be 'auto', 'cuda' or 'host', got '",
                    backend, "'");
  std::lock_guard<std::mutex> lock(g_mu);
  g_config = Config{backend, pinned_limit, min_chunk, max_in_flight, host_copy_delay_us};
  // The old engine only serves the tensors it still owns: give back its spare chunks.
  if (g_engine != nullptr && g_pid == getpid()) g_engine->empty_cache();
  // The next use builds a new engine lazily (no CUDA initialisation at import).
  // The previous one is kept alive for the tensors it still owns.
  g_engine = nullptr;
}

}  // namespace offcache
