// The engine: store (D2H) and fetch (H2D) over a pinned host arena, with a
// tensor-identity dedup table, event-ordered copy streams, deferred frees
// and a bound on bytes in flight. Backend-independent: only the primitives
// in backend.h differ between CUDA and host.
#pragma once

#include <ATen/Tensor.h>

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"
#include "core/arena.h"
#include "core/deferred_free.h"
#include "core/page_source.h"
#include "dedup.h"
#include "host_block.h"

namespace offcache {

struct EngineStats {
  size_t pinned_reserved_bytes = 0, pinned_in_use_bytes = 0, pageable_bytes = 0;
  size_t in_flight_bytes = 0, deferred_bytes = 0;
  size_t peak_pinned_reserved_bytes = 0, peak_pinned_in_use_bytes = 0;
  size_t peak_pageable_bytes = 0, peak_in_flight_bytes = 0;
  size_t dedup_hits = 0, spills = 0, stores = 0, fetches = 0;
  size_t d2h_bytes = 0, h2d_bytes = 0, d2h_copies = 0, h2d_copies = 0;
  double d2h_seconds = 0, h2d_seconds = 0;
  size_t pinned_limit_bytes = 0;
  size_t dedup_entries = 0;
};

class Engine {
 public:
  Engine(std::unique_ptr<Backend> backend, ArenaOptions arena, size_t max_in_flight);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // values: tensors of any shape and dtype, on a device or the CPU.
  // Returns, in order, their copies on `target`: CPU views of arena memory
  // (or pageable memory past the budget) for CPU, device tensors otherwise.
  // allow_spill=false returns a value unchanged where the arena is full.
  std::vector<at::Tensor> store(const std::vector<at::Tensor>& values, c10::Device target,
                                bool allow_spill = true);
  // stored: tensors returned by store() (or any tensors). Returns copies on
  // `device` (a tensor already there that offcache does not own is returned
  // as is) and the copy's completion event. With wait=true the current
  // stream of `device` already waits on it; otherwise call wait() before use.
  struct Fetched {
    std::vector<at::Tensor> tensors;
    EventPtr done;
    std::vector<std::shared_ptr<std::atomic<bool>>> torn;  // checked by check_torn()
  };
  Fetched fetch(const std::vector<at::Tensor>& stored, c10::Device device, bool wait);
  // Raises if a value's store read a source that was being modified in place.
  static void check_torn(const std::vector<std::shared_ptr<std::atomic<bool>>>& flags);
  void wait(const EventPtr& event, c10::Device device);
  // Blocks the calling thread until the store that produced `t` has completed,
  // so its memory can be read directly.
  void wait_stored(const at::Tensor& t);
  // Waits for every copy in flight and frees what can be freed.
  void synchronize();
  // synchronize(), then returns every empty arena chunk to the OS; returns bytes released.
  size_t empty_cache();

  // Copy timeline: while tracing, every completed copy batch is recorded with
  // its start and end in ms after an origin event on `device`'s current stream.
  struct TraceRow {
    Dir dir;
    size_t bytes;
    double start_ms, end_ms;
  };
  void trace_start(c10::Device device);
  std::vector<TraceRow> trace_stop();

  EngineStats stats();
  void set_limit(size_t bytes);
  // A one-time message when values first spill to pageable memory ("" if none).
  std::string take_spill_notice();
  const Backend& backend() const { return *backend_; }
  bool arena_pinned() const { return backend_->chunks().pinned(); }
  bool is_arena_tensor(const at::Tensor& t) const;

  // DataPtr deleter path; may run on any thread.
  void release(HostBlock* block) noexcept;

 private:
  struct InFlight {
    EventPtr start, done;
    size_t bytes;
    Dir dir;
    std::vector<at::Tensor> keepalive;  // sources and buffers the copy reads or writes
  };
  struct Source {
    at::Tensor tensor;  // contiguous
    EventPtr dep;       // store completion the copy must wait for, if any
  };

  Source resolve_source(const at::Tensor& t);
  EventPtr store_event_of(const at::Tensor& t);              // needs mu_
  HostBlock* allocate_host(size_t bytes, bool allow_spill);  // needs mu_
  void free_block(const Block& block);                       // needs mu_
  // Issues one batch of copies on the copy stream of `device`.
  EventPtr issue(Dir dir, c10::Device device, const std::vector<EventPtr>& deps,
                 const std::vector<CopyOp>& ops, size_t bytes, std::vector<at::Tensor> keepalive,
                 std::function<void()> after_copy = nullptr);
  void throttle(size_t incoming);
  // Moves completed in-flight entries out (destroyed by the caller, unlocked).
  std::vector<InFlight> reap_locked();
  void note_peaks_locked();
  std::vector<at::Tensor> store_to_host(const std::vector<at::Tensor>& sources, bool allow_spill,
                                        std::vector<bool>* stored);
  at::Tensor store_to_device(const at::Tensor& source, c10::Device target);

  std::unique_ptr<Backend> backend_;
  std::mutex mu_;  // guards everything below; never held while a tensor dies
  PageSource pageable_;
  Arena arena_;
  DeferredFrees deferred_;
  DedupTable dedup_;
  std::deque<InFlight> in_flight_;
  std::unordered_map<const c10::StorageImpl*,
                     std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, EventPtr>>
      device_stores_;  // peer-stored device tensors -> store completion
  size_t max_in_flight_;
  EngineStats stats_;
  bool spill_warned_ = false;
  EventPtr trace_origin_;  // non-null while tracing
  std::vector<TraceRow> trace_;
  std::string spill_notice_;
};

// The process-wide engine, created on first use with the configured backend.
Engine& global_engine();
void configure_global_engine(const std::string& backend, size_t pinned_limit, size_t min_chunk,
                             size_t max_in_flight, int64_t host_copy_delay_us);
bool global_engine_created();

}  // namespace offcache
