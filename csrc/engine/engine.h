// The engine: store (D2H) and fetch (H2D) over a pinned host arena, with a
// tensor-identity dedup table, event-ordered copy streams, deferred frees
// and a bound on bytes in flight. Backend-independent: only the copy streams
// and events of backend.h differ between CUDA and host.
//
// A store is a snapshot taken at the call: the values are copied on their
// producer's stream (a device-to-device copy into an offcache-owned staging
// buffer; on the host, a memcpy on the calling thread) and then drained into
// the arena on the copy stream. Whatever the caller does to a source after
// store() returns cannot change what was stored.
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "core/arena.h"
#include "core/deferred_free.h"
#include "core/disk_file.h"
#include "core/host_stream.h"
#include "core/in_flight.h"
#include "core/lifetime.h"
#include "core/page_source.h"
#include "dedup.h"
#include "engine_mutex.h"
#include "host_block.h"

namespace offcache {

namespace detail {
struct SpanTally;  // engine_detail.h
}  // namespace detail

struct EngineStats {
  size_t pinned_reserved_bytes = 0, pinned_in_use_bytes = 0, pageable_bytes = 0;
  size_t in_flight_bytes = 0, deferred_bytes = 0;
  size_t peak_pinned_reserved_bytes = 0, peak_pinned_in_use_bytes = 0;
  size_t peak_pageable_bytes = 0, peak_in_flight_bytes = 0;
  size_t peak_host_bytes = 0;     // pinned in use + pageable, staging included: the host limit's
  uint64_t threads_prepared = 0;  // engine threads that selected their device (prepare_thread)
  uint64_t chunks_made = 0, chunks_released = 0;  // chunk registrations (CUDA), mmaps (host)
  uint64_t chunks_kept_registered = 0;  // released chunks whose unregister failed: kept mapped
  size_t dedup_hits = 0, spills = 0, stores = 0, fetches = 0;
  // Stores whose copy took a dropped value's block while the copies touching it were still
  // in flight, ordered after them on the copy stream, instead of a new block (or chunk).
  size_t blocks_reused_in_order = 0;
  size_t staging_reserved_bytes = 0;  // the host backend's snapshot staging (its device memory)
  // Memory the fetches allocated for their outputs (one per value of 1 MiB and more, one per
  // packed span of smaller values, whose outputs share it), and the outputs handed to the
  // consumer's stream (on CUDA each is one recordStream on that memory): per span, not per value.
  size_t output_allocations = 0, handovers = 0;
  // The allocator's free-and-retry (each synchronised the device: the fetch waited for queued
  // compute) met while allocating fetch outputs, and the fetches whose outputs came from the
  // consumer's pool to keep off it, near the allocator's limit (Backend::outputs_fit_copy_stream).
  size_t output_alloc_retries = 0, consumer_pool_fetches = 0;
  size_t d2h_bytes = 0, h2d_bytes = 0, d2h_copies = 0, h2d_copies = 0;
  size_t snapshot_bytes = 0, snapshot_fallbacks = 0;
  size_t inline_store_copies = 0;  // CPU values copied by the storing thread
  size_t snapshot_oom_skips = 0;   // stores that skipped staging after a recent device OOM
  size_t chunk_bytes = 0;          // arena chunks made (pinned on CUDA)
  double chunk_seconds = 0;        // time making them: mmap, pre-faulting, registration
  double d2h_seconds = 0, h2d_seconds = 0;
  size_t pinned_limit_bytes = 0;
  size_t dedup_entries = 0;
  size_t lock_waits_over_1ms = 0;
  size_t leaked_blocks = 0;  // kept forever after a broken CUDA context
  // Backend primitives (backend.h, Counters).
  uint64_t events_created = 0, events_recorded = 0, stream_waits = 0, copy_calls = 0;
  uint64_t host_callbacks = 0, pinned_registrations = 0, syncs = 0, event_queries = 0;
  uint64_t pinned_queries = 0;  // driver calls asking whether a foreign fetch source is pinned
  // Packed spans alive (allocations shared by a fetch's small outputs), their bytes, and the
  // bytes of their live outputs: a span retains at most 256 KiB or 16x its smallest output.
  size_t packed_spans = 0, packed_span_bytes = 0, packed_output_bytes = 0;
  // Disk tier (0 without a disk dir).
  size_t host_limit_bytes = 0, disk_bytes = 0, disk_reserved_bytes = 0, peak_disk_bytes = 0;
  size_t disk_files = 0, disk_write_bytes = 0, disk_read_bytes = 0;
  size_t disk_fallbacks = 0;
  size_t bounce_reserved_bytes = 0;  // disk I/O buffers and fetch_file's ring, outside the budget
  size_t bounce_pageable = 0;        // I/O buffers that did not fit them: pageable
  double disk_write_seconds = 0, disk_read_seconds = 0;
  // fetch_file: calls, bytes read from files, pieces served by the page cache, pieces
  // read from the disk without O_DIRECT (refused), read time.
  size_t file_fetches = 0, file_read_bytes = 0, file_cached_reads = 0, file_buffered_reads = 0;
  double file_read_seconds = 0;
};

// A store would take host memory (pinned + pageable) past the host limit and
// there is no disk tier to take it: Python's offcache.HostLimitError (a MemoryError).
struct HostLimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The disk tier: past `host_limit` bytes of host memory (pinned + pageable),
// stored values go to files under `dir`. Empty dir: no disk tier, and a store
// past the limit raises HostLimitError.
struct DiskOptions {
  std::string dir;
  size_t host_limit = SIZE_MAX;
};

// What a batch of copies keeps alive until it completes (core/in_flight.h).
using Tensors = std::vector<at::Tensor>;
using HeldTensors = std::shared_ptr<Held<Tensors>>;
inline HeldTensors hold(Tensors until_done, Tensors until_queued = {}) {
  return std::make_shared<Held<Tensors>>(std::move(until_done), std::move(until_queued));
}

class Engine final : public BlockOwner {
 public:
  Engine(std::unique_ptr<Backend> backend, ArenaOptions arena, size_t max_in_flight,
         DiskOptions disk = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // values: tensors of any shape and dtype, on a device or the CPU.
  // Returns, in order, their snapshots on `target`: CPU views of arena memory
  // (or pageable memory past the budget) for CPU, device tensors otherwise.
  // Dense layouts (e.g. channels_last) keep their strides; conj/neg bits are
  // resolved. allow_spill=false returns a value unchanged where the arena is full.
  std::vector<at::Tensor> store(const std::vector<at::Tensor>& values, c10::Device target,
                                bool allow_spill = true);
  // stored: tensors returned by store() (or any tensors). Returns independent
  // copies on `device` (a tensor already there that offcache does not own is
  // returned as is) and the copy's completion event. With wait=true the
  // current stream of `device` already waits on it; otherwise the caller
  // makes it wait (Event::wait_current) before use.
  // `held`: what the engine keeps alive for the copies (the outputs among it);
  // whoever proves them queued or complete (a ticket's wait) may take it early.
  struct Fetched {
    std::vector<at::Tensor> tensors;
    EventPtr done;
    std::vector<HeldTensors> held;
    std::shared_ptr<Handoff> handoff;  // for a ticket waited on another stream (null: none)
  };
  Fetched fetch(const std::vector<at::Tensor>& stored, c10::Device device, bool wait);
  // Tensors read from byte ranges of the file at `path` onto `device`:
  // tensor i has likes[i]'s dtype and shape (likes may be meta tensors), is
  // contiguous, and holds the file's bytes [offsets[i], offsets[i] + nbytes).
  // The I/O thread reads the file kDiskPiece at a time (from the page cache
  // where a piece is there, else O_DIRECT where the file system allows it) into bounce buffers
  // (pinned on CUDA) and issues each piece's copies itself: the calling thread never waits for the
  // disk, and each piece's copy overlaps the next piece's read. The file's bytes must not change
  // until `done`. wait: as fetch's.
  Fetched fetch_file(const std::string& path, const std::vector<int64_t>& offsets,
                     const std::vector<at::Tensor>& likes, c10::Device device, bool wait);
  // Copies srcs[i] into the existing dsts[i] (same dtype and shape) on the
  // copy streams. One side is offcache host memory or a device, the other a
  // device or offcache host memory; each side must be rows of contiguous
  // bytes at one pitch. Sources stay alive until the copy completes; they
  // must not be modified before then (no snapshot is taken).
  EventPtr copy_into(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                     bool wait);
  // Blocks the calling thread until the store that produced `t` has completed,
  // so its memory can be read directly.
  void wait_stored(const at::Tensor& t);
  // Waits for every copy in flight and frees what can be freed; then raises
  // a copy-stream task's error, if one failed (check).
  void synchronize(bool check = true);
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
  // Timed events (per-direction seconds in stats) cost driver work: off by default.
  void set_timing(bool on);

  EngineStats stats();
  // The pinned budget: the arena's limit is it less the shared mappings' share (shared_region.h),
  // applied here, at stats() and at refresh_shared_share().
  void set_limit(size_t bytes);
  size_t pinned_budget();
  void refresh_shared_share();
  // A one-time message when values first spill to pageable memory ("" if none).
  std::string take_spill_notice();
  const Backend& backend() const { return *backend_; }
  // Run first by a thread the engine's owner starts for it (the one deleting a
  // retired engine): Backend::prepare_thread.
  void prepare_thread() { backend_->prepare_thread(); }
  bool arena_pinned() const { return backend_->chunks().pinned(); }
  size_t reserved_bytes();  // without reaping: no tensor dies in it
  bool is_arena_tensor(const at::Tensor& t) const;

  // DataPtr deleter path; may run on any thread; never throws.
  void release(HostBlock* block) noexcept override;
  bool fence_done(const EventPtr& event) override { return backend_->query(event); }
  // Blocks and calls that keep a retired engine alive (core/lifetime.h).
  Lifetime& lifetime() { return lifetime_; }
  // A call is using the engine (EngineUse): a retired engine is not deleted
  // under it. leave() deletes it if it was the last reason to live.
  void enter() { lifetime_.enter(); }
  void leave() noexcept;

  // Fork: held across fork() so no engine lock is taken at that moment.
  void lock_for_fork() { mu_.lock(); }
  // In the parent and in the child: the disk files both now map are sealed,
  // so neither process writes where the other may read (new values go to new
  // files of their own; sealed files go once their last value dies).
  void unlock_after_fork() {
    if (disk_arena_) disk_arena_->seal_all();
    mu_.unlock();
  }

 private:
  using Retire =
      Retiring<Tensors, EngineMutex>;  // mu_ and what is retired under it, destroyed after it

  std::unique_lock<EngineMutex> lock();  // mu_, with contention counted
  Retire retiring() { return Retire(lock()); }
  // Raises the first error a copy-stream or I/O task threw (sticky).
  void check_streams();
  // backend_->resolve_device(d) once per distinct device of a call (`seen`
  // holds those checked): it costs a device guard and a capture query.
  void resolve_once(c10::Device d, std::vector<c10::Device>* seen);
  // The last event queried in a call: the values of one block share one.
  struct QueryMemo {
    const Event* event = nullptr;
    bool done = false;
  };
  bool is_complete(const EventPtr& e, QueryMemo* memo);  // a counted query, memoised
  EventPtr pending_write_of(const at::Tensor& t, QueryMemo* memo = nullptr);  // needs mu_
  // Drops the completed events of a device storage's reads; keeps all when a query throws.
  // Whether CPU tensor `t`, which no arena block holds, is pinned: known from its
  // allocator (torch's CPU allocator, or the backend's pinned one), else asked once per
  // storage (a driver call, Counters::pinned_queries) and remembered. Only counts use it.
  bool foreign_pinned(const at::Tensor& t);
  void drop_completed_reads(std::vector<EventPtr>* reads);
  // Appends the D2H copies still reading device tensor `t`'s storage (needs mu_).
  void pending_reads_of(const at::Tensor& t, std::vector<EventPtr>* out);
  // Records a copy_into that reads or writes device tensor `t` (needs mu_).
  void note_device_access(const at::Tensor& t, const EventPtr& done, bool write);
  // A dedup hit is served only if the stored copy still holds the source's bytes.
  bool same_bytes(const at::Tensor& source, const at::Tensor& stored);  // needs mu_
  // A host block for `bytes` (takes mu_), within the host limit: past it, waits for
  // copies whose completion frees host memory, then goes to disk (a disk tier),
  // raises HostLimitError, or returns nullptr (staging, or allow_spill=false).
  // staging: a snapshot's transient buffer, whose spill is not a value's.
  // write_after, for a block that only a copy stream writes (a GPU store), which
  // orders that copy after the events it receives here: instead of a new chunk
  // the block may be a dropped value's whose copies are still in flight, and
  // *write_after gets their fences (empty otherwise).
  HostBlock* allocate_host(size_t bytes, bool allow_spill, bool staging = false,
                           std::vector<EventPtr>* write_after = nullptr);
  // allocate_host's memory block; *retry when another thread took the room meanwhile.
  HostBlock* allocate_in_memory(size_t bytes, bool allow_spill, bool staging, bool* retry,
                                std::vector<EventPtr>* write_after);
  // Host memory held against the host limit: arena blocks in use and pageable ones (needs mu_).
  size_t host_held_locked() const;
  // The most a host block of `bytes` takes (arena- or page-rounded).
  size_t host_need(size_t bytes) const;
  // Waits (unlocked) for copies whose completion frees host memory until `bytes`
  // more fit under the host limit; false when nothing pending can make room.
  // *held: host memory held at the last look. Takes mu_.
  bool wait_for_host_room(size_t bytes, size_t* held);
  // Past the host limit, a block of the disk arena, else nullopt (takes mu_;
  // new files are made without it; raises, naming the folder and bytes, when
  // the disk is full).
  std::optional<Block> allocate_disk(size_t bytes);
  // Temporary memory for disk I/O, kDiskAlign-aligned at `*aligned` (takes mu_;
  // new bounce chunks are made without it).
  Block allocate_bounce(size_t bytes, char** aligned);
  Block allocate_pageable_bounce_locked(size_t bytes, char** aligned);  // needs mu_
  // Queues the write of a disk block's bytes, staged in `bounce`, after `after`;
  // returns the write's completion (the block's `stored`).
  EventPtr write_to_disk(HostBlock* hb, const Block& bounce, const char* data, size_t bytes,
                         const EventPtr& after);
  // Queues reads of [src, src + bytes) of a disk block into `*dst` on io_, in kDiskPiece pieces.
  void read_from_disk(const char* src, size_t bytes, char* dst);
  // `slot`'s I/O thread (io_ or file_io_), started on first use (takes mu_; the
  // thread is made without it).
  HostStream& io_stream(std::unique_ptr<HostStream>& slot);
  // fetch_file's bounce ring: kFileRing pieces, made on first use (takes mu_).
  char* file_ring();
  void free_block(const Block& block);  // needs mu_
  void reclaim_locked();
  // Issues one batch of copies on `stream` after `deps`; returns their completion.
  // `held` lives until then (in the ledger).
  EventPtr issue(Dir dir, CopyStream& stream, const std::vector<EventPtr>& deps,
                 const std::vector<CopyOp>& ops, HeldTensors held);
  // issue(), but by the I/O thread once the reads queued on io_ before it are done;
  // returns a ChainedEvent at once.
  EventPtr issue_after_reads(Dir dir, CopyStream& stream, std::vector<EventPtr> deps,
                             std::vector<CopyOp> ops, HeldTensors held);
  // Lists a batch issued on `stream` as in flight, then reaps (under r's lock).
  void track_locked(Retire& r, EventPtr start, EventPtr done, Dir dir, size_t bytes, size_t copies,
                    HeldTensors held, const void* stream, bool bounded);
  void throttle(size_t incoming, Dir dir);
  // Retires completed batches into r (their tensors die after r's lock is released).
  void reap_locked(Retire& r);
  void note_peaks_locked();
  std::vector<at::Tensor> store_to_host(const std::vector<at::Tensor>& sources, bool allow_spill,
                                        std::vector<bool>* stored);
  at::Tensor store_to_device(const at::Tensor& source, c10::Device target);
  // A snapshot's staging memory: device memory on the producer's stream, or
  // an arena block for host sources (undefined past the host limit).
  at::Tensor staging_buffer(size_t bytes, c10::Device device);

  std::unique_ptr<Backend> backend_;
  // Guards everything below. Never held while a tensor dies (its block's
  // release takes it) nor while anything may wait for the GIL: a release takes
  // it on a thread that may hold the GIL. So under it no tensor that Python
  // may own changes its reference count (docs/design.md, "Locks and the GIL").
  EngineMutex mu_;
  ReleaseUnlocked chunks_;  // backend_->chunks(), released once mu_ is free
  PageSource pageable_;
  Arena arena_;
  DeferredFrees deferred_;
  DedupTable dedup_;
  InFlightLedger<Tensors> in_flight_;
  std::unordered_map<const c10::StorageImpl*,
                     std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, EventPtr>>
      device_stores_;  // device tensors written by a copy -> its completion
  std::unordered_map<const c10::StorageImpl*,
                     std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::vector<EventPtr>>>
      device_reads_;  // device tensors read by copy_into's D2H copies -> those copies
  struct PinnedMemo {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const void* data;
    bool pinned;
  };
  std::unordered_map<const c10::StorageImpl*, PinnedMemo> pinned_memo_;  // foreign_pinned()'s
  size_t pinned_memo_inserts_ = 0;
  // The packed spans of this engine's fetches (outputs may outlive it: shared).
  std::shared_ptr<detail::SpanTally> span_tally_;
  size_t max_in_flight_;
  EngineStats stats_;
  bool spill_warned_ = false;
  bool timing_ = false;
  size_t pinned_budget_ = 0;  // set_limit()'s bytes; the arena gets it less the shared share
  bool broken_ = false;       // a release found the CUDA context broken
  Lifetime lifetime_;
  size_t staging_bytes_ = 0;  // host blocks used as snapshot staging (needs mu_)
  size_t device_notes_ = 0;   // note_device_access calls, for pruning the device maps
  // Per GPU: the staging size that last ran out of device memory, and until when
  // staging that large is not tried again.
  std::unordered_map<int, std::pair<size_t, std::chrono::steady_clock::time_point>> staging_oom_;
  EventPtr trace_origin_;  // non-null while tracing
  std::vector<TraceRow> trace_;
  std::string spill_notice_;
  // Disk tier (null without a disk dir). Declared after the arena: destroyed first.
  DiskOptions disk_options_;
  std::unique_ptr<DiskSource> disk_;
  std::unique_ptr<Arena> disk_arena_;
  std::unique_ptr<Arena> bounce_arena_;   // the disk tier's I/O buffers, outside the pinned budget
  std::unique_ptr<Arena> staging_arena_;  // host snapshots' staging (from pageable_)
  bool disk_warned_ = false;
  // Pageable disk I/O buffers kept for reuse, up to kBouncePoolBytes (few: a linear search).
  std::vector<Block> bounce_pool_;
  size_t bounce_pool_bytes_ = 0;
  std::atomic<size_t> disk_write_bytes_{0}, disk_read_bytes_{0};
  std::atomic<int64_t> disk_write_ns_{0}, disk_read_ns_{0};
  std::atomic<size_t> disk_fallbacks_{0};  // aligned I/O that O_DIRECT refused: buffered instead
  std::atomic<size_t> file_read_bytes_{0}, file_cached_reads_{0}, file_buffered_reads_{0};
  std::atomic<int64_t> file_read_ns_{0};
  std::atomic<size_t> lock_waits_over_1ms_{0};
  // fetch_file's ring (null until the first) and, touched by file_io_'s thread
  // only, the next slot and the copies still reading each slot.
  std::optional<Block> file_ring_;
  size_t file_next_slot_ = 0;
  std::vector<EventPtr> file_slot_reads_;
  // The I/O threads: never hold mu_ or the GIL while waiting; made on first
  // use. io_: the disk tier's; file_io_: fetch_file's, which waits for copies
  // (its ring) where the disk tier's copies wait for io_: one thread would
  // deadlock. Last: stopped first.
  std::unique_ptr<HostStream> io_;
  std::unique_ptr<HostStream> file_io_;
};

// The process-wide engine (created on first use with the configured backend),
// held for the length of one call: configure() on another thread retires it
// but cannot delete it meanwhile.
class EngineUse {
 public:
  EngineUse();
  ~EngineUse() {
    scope_.reset();  // before leave(): the engine may go with it
    engine_->leave();
  }
  EngineUse(const EngineUse&) = delete;
  EngineUse& operator=(const EngineUse&) = delete;
  Engine& operator*() const { return *engine_; }
  Engine* operator->() const { return engine_; }

 private:
  Engine* engine_;
  std::unique_ptr<Backend::CallScope> scope_;  // Backend::enter_call(), for the call's length
};
void configure_global_engine(const std::string& backend, size_t pinned_limit, size_t min_chunk,
                             size_t max_in_flight, int64_t host_copy_delay_us,
                             const std::string& disk_dir = "", size_t host_limit = SIZE_MAX);
// synchronize() on every engine: the current one and those replaced by configure().
void synchronize_all();
// Engines replaced by configure() that still serve tensors, and their reserved bytes.
std::pair<size_t, size_t> retired_engines();
// Called when a retired engine may have become idle (its last block or call
// went): deletes it, off the calling thread, if it is still listed and idle.
void delete_retired(Engine* engine);

}  // namespace offcache
