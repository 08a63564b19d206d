// Host memory shared between processes: the mappings of offcache.weights.node's region. Each
// mapping is made here once per process and registered once (pinned on CUDA), so a fetch from it
// is an asynchronous copy from pinned memory; its storage's deleter unregisters it after the
// copies still reading it, then unmaps it. Process-wide, not an engine's: a mapping outlives
// configure(), and a registration is the driver's, not an engine's.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/event.h"

namespace offcache {

// Registrations of one mapping are at most this big (vLLM's bound for cudaHostRegister).
constexpr size_t kRegisterChunk = size_t{64} << 30;

// One mapping of a shared file: [base, base + bytes).
struct SharedSpan {
  char* base = nullptr;
  size_t bytes = 0;
  size_t share = 0;         // bytes counted against this process's pinned budget (registered)
  bool registered = false;  // every chunk registered (pinned on CUDA)
  bool cuda = false;        // registered with cudaHostRegister (else bookkeeping only)
  int device = -1;          // the GPU selected around its (un)registrations (-1: the current one)
  int owner_pid = 0;        // a forked child unmaps without unregistering
  std::vector<std::pair<char*, size_t>> chunks;  // the registered chunks
  std::mutex mu;
  std::vector<EventPtr> fences;  // copies that read it, not yet seen complete (under mu)
  // Adds `event` (a copy reading the span); completed fences are dropped now and then.
  void add_fence(const EventPtr& event);
  // The fences not seen complete (all of them when a query throws: never fewer than pending).
  std::vector<EventPtr> pending();
  void drop_completed_locked() noexcept;  // needs mu
};

// What map_shared() made: the span's bytes as a uint8 CPU tensor (its storage owns the mapping)
// and, when it is not registered, why ("" when it is).
struct SharedMapping {
  at::Tensor bytes;
  std::string reason;
};

// Maps [offset, offset + bytes) of the open file `fd` (MAP_SHARED, read-write) and registers the
// mapping in chunks of at most kRegisterChunk: on CUDA (`cuda`) each chunk is a cudaHostRegister
// (portable) made in relaxed capture mode on the calling thread, every return code checked; a
// failure unregisters the chunks already made and leaves the mapping unregistered (pageable), with
// the reason. The registrations, and the unregistrations when it dies (on whatever thread drops
// it), run on GPU `device` (the engine's: Backend::claim_device), so that no thread makes a
// context on another GPU. On the host backend the same bookkeeping with no driver call. Ranks
// registering at the same time register their own mappings of the same pages: nothing is shared
// between them. `ranks` processes map the same bytes: each counts ceil(bytes / ranks) against its
// pinned budget `budget` (the node's region counts once per node); a mapping whose share would take
// the process's shares past `budget` is not registered (the reason says so).
SharedMapping map_shared(int fd, size_t offset, size_t bytes, size_t ranks, bool cuda, int device,
                         size_t budget);

// The span a CPU tensor's storage is a mapping of (map_shared), or nullptr.
SharedSpan* shared_span_of(const at::Tensor& t);
// Blocks until the copies reading `t`'s span (any engine's) completed: then it may be written.
// Then unmaps the dead mappings whose copies completed (reap_shared).
void wait_shared_reads(const at::Tensor& t);
// Unregisters and unmaps the mappings whose storage died while copies read them, once those
// copies completed (a mapping that dies with none reading it goes at once). Run by the engine's
// synchronize() and fetches (not under its lock) and by every region call; cheap when none waits.
void reap_shared();
// Atomically adds `delta` to the 8-byte word `word` (a CPU tensor of 8 bytes, 8-aligned) and
// returns the new value (delta 0: a load). Sequentially consistent: the region's generations.
uint64_t shared_word_add(const at::Tensor& word, uint64_t delta);

// Process-wide figures (offcache.stats(): the shared_* keys).
struct SharedStats {
  size_t mapped_bytes = 0;                 // live mappings
  size_t registered_bytes = 0;             // of them, registered (pinned on CUDA)
  size_t pinned_share_bytes = 0;           // what they count against this process's pinned budget
  size_t mappings = 0, registrations = 0;  // live mappings; chunk registrations made, ever
  size_t register_failures = 0;            // mappings left unregistered
  size_t unregister_failures = 0;          // chunks kept registered (and mapped) for good
  double register_seconds = 0;
  size_t fetches = 0, fetch_bytes = 0, pinned_fetch_bytes = 0;  // fetches reading a span
  size_t deferred_unmaps = 0;  // dead mappings waiting for their copies
};
SharedStats shared_stats();
// The bytes counted against this process's pinned budget now.
size_t shared_pinned_share();
// A fetch read `bytes` from spans (`pinned`: all registered).
void note_shared_fetch(size_t bytes, bool pinned);

// Tests: the registration of chunk `after` (0: the first) of the next map_shared() fails with
// `reason`, once (both backends). OFFCACHE_FAIL_REGISTER=<reason> in the environment fails every
// registration (a process spawned to fall back). `chunk` > 0 sets the chunk size (0: the default).
void fail_register(int after, const std::string& reason);
void set_register_chunk(size_t chunk);

}  // namespace offcache
