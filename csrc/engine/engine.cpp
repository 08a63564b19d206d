#include "engine.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "engine_detail.h"
#include "region/shared_region.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

Engine::Engine(std::unique_ptr<Backend> backend, ArenaOptions arena, size_t max_in_flight,
               DiskOptions disk)
    : backend_(std::move(backend)),
      chunks_(backend_->chunks(), mu_),
      arena_(chunks_, arena),
      span_tally_(std::make_shared<SpanTally>()),
      max_in_flight_(max_in_flight),
      pinned_budget_(arena.limit),
      disk_options_(std::move(disk)) {
  arena_.set_limit(pinned_budget_ - std::min(pinned_budget_, shared_pinned_share()));
  if (!disk_options_.dir.empty()) {
    disk_ = std::make_unique<DiskSource>(disk_options_.dir);
    ArenaOptions options;
    options.min_chunk = kDiskMinChunk;
    options.alignment = kDiskAlign;
    disk_arena_ = std::make_unique<Arena>(*disk_, options);
  }
  // The disk tier's and fetch_file's I/O buffers; its chunks are made on first use.
  ArenaOptions bounce;
  bounce.min_chunk = bounce.max_chunk = kBounceChunkBytes;
  bounce.limit = kBounceArenaBytes;
  bounce.alignment = kDiskAlign;
  // Its chunks stay until empty_cache(): each costs a registration to make and give back,
  // and the disk tier cycles through them on every store and fetch.
  bounce.keep_empty_chunks = true;
  bounce_arena_ = std::make_unique<Arena>(chunks_, bounce);
  // Host snapshots' staging: plain pre-faulted memory beside the pinned arena, as a GPU
  // snapshot's staging is device memory beside it. Counted against the host limit.
  ArenaOptions staging;
  staging.min_chunk = arena.min_chunk;
  staging.max_chunk = arena.max_chunk;
  staging_arena_ = std::make_unique<Arena>(pageable_, staging);
}

Engine::~Engine() {
  // Only a retired engine with no live block is deleted: wait for its copies,
  // then the arena gives its chunks back and the copy streams stop.
  try {
    synchronize(/*check=*/false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offcache: retiring an engine: %s\n", e.what());
  }
  if (file_ring_) {
    // Freed only once nothing can touch it: every task has run and its slots' copies are
    // done (synchronize above may have stopped at a broken event). Else it is leaked.
    bool idle = true;
    try {
      if (file_io_) file_io_->synchronize();
      for (const EventPtr& e : file_slot_reads_) {
        if (e) e->wait();
      }
    } catch (const std::exception&) {
      idle = false;
    }
    auto l = lock();
    if (idle) free_block(*file_ring_);
  }
  for (const Block& b : bounce_pool_) pageable_.release(b.ptr, b.size);
  chunks_.release_now();  // the arenas' destructors give back their chunks unlocked
}

std::unique_lock<EngineMutex> Engine::lock() {
  std::unique_lock<EngineMutex> l(mu_, std::try_to_lock);
  if (l.owns_lock()) return l;
  const auto t0 = std::chrono::steady_clock::now();
  l.lock();
  if (std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(1)) ++lock_waits_over_1ms_;
  return l;
}

void Engine::check_streams() {
  std::string e = backend_->stream_error();
  HostStream *io, *file_io;
  {
    auto l = lock();
    io = io_.get();
    file_io = file_io_.get();
  }
  if (e.empty() && io) e = io->error();
  if (e.empty() && file_io) e = file_io->error();
  TORCH_CHECK(e.empty(), "offcache: a copy on one of the engine's streams failed: ", e,
              ". The copies queued after it were skipped, so values stored or fetched since are "
              "incomplete; offcache.configure() starts a new engine");
}

void Engine::resolve_once(c10::Device d, std::vector<c10::Device>* seen) {
  if (std::find(seen->begin(), seen->end(), d) != seen->end()) return;
  backend_->resolve_device(d);
  seen->push_back(d);
}

bool Engine::is_arena_tensor(const at::Tensor& t) const {
  HostBlock* hb = host_block_of(t);
  return hb != nullptr && hb->owner == this && hb->pinned();
}

void Engine::leave() noexcept {
  if (!lifetime_.leave()) return;
  try {
    delete_retired(this);
  } catch (...) {  // no thread to be had: the engine stays (a leak, not a crash)
  }
}

std::string Engine::take_spill_notice() {
  auto l = lock();
  return std::exchange(spill_notice_, std::string());
}

void Engine::set_limit(size_t bytes) {
  auto l = lock();
  pinned_budget_ = bytes;
  arena_.set_limit(bytes - std::min(bytes, shared_pinned_share()));
  spill_warned_ = false;
}

size_t Engine::pinned_budget() {
  auto l = lock();
  return pinned_budget_;
}

void Engine::refresh_shared_share() {
  auto l = lock();
  arena_.set_limit(pinned_budget_ - std::min(pinned_budget_, shared_pinned_share()));
}

void Engine::set_timing(bool on) {
  auto l = lock();
  timing_ = on;
}

void Engine::note_peaks_locked() {
  auto& s = stats_;
  s.peak_pinned_reserved_bytes = std::max(s.peak_pinned_reserved_bytes, arena_.reserved_bytes());
  s.peak_pinned_in_use_bytes = std::max(s.peak_pinned_in_use_bytes, arena_.in_use_bytes());
  s.peak_pageable_bytes = std::max(s.peak_pageable_bytes, s.pageable_bytes);
  s.peak_host_bytes = std::max(s.peak_host_bytes, host_held_locked());
  s.peak_in_flight_bytes = std::max(s.peak_in_flight_bytes, in_flight_.bytes());
  if (disk_arena_) s.peak_disk_bytes = std::max(s.peak_disk_bytes, disk_arena_->in_use_bytes());
}

EventPtr Engine::issue_after_reads(Dir dir, CopyStream& stream, std::vector<EventPtr> deps,
                                   std::vector<CopyOp> ops, HeldTensors held) {
  size_t bytes = 0;
  for (const auto& op : ops) bytes += op.total();
  const size_t copies = ops.size();
  auto chained = std::make_shared<ChainedEvent>();
  io_->submit([this, &stream, chained, deps = std::move(deps), ops = std::move(ops)] {
    EventPtr done;
    try {
      done = stream.copy_after(deps, ops);
    } catch (const std::exception& e) {
      stream.synchronize_noexcept();  // what was queued lands before the chain completes
      chained->fail(std::string("issuing a disk-tier fetch: ") + e.what());
      throw;  // sticky: the next engine call raises it
    }
    chained->set(std::move(done));
    chained->finish();
  });
  chained->issued_by(io_->record());
  Retire r = retiring();
  track_locked(r, nullptr, chained, dir, bytes, copies, std::move(held), chained.get(), true);
  return chained;
}

bool Engine::is_complete(const EventPtr& e, QueryMemo* memo) {
  if (memo && memo->event == e.get()) return memo->done;
  bool complete;
  try {
    complete = backend_->query(e);
  } catch (const EventUnknown&) {
    // Refused for now (another thread's graph capture): taken as still running, so the
    // caller orders its work after it (a stream wait), as for any copy in flight.
    return false;
  }
  if (memo) *memo = QueryMemo{e.get(), complete};
  return complete;
}

EventPtr Engine::pending_write_of(const at::Tensor& t, QueryMemo* memo) {
  // A write seen complete is forgotten: later lookups cost no query.
  if (HostBlock* hb = host_block_of(t)) {
    if (hb->stored && is_complete(hb->stored, memo)) hb->stored.reset();
    return hb->stored;
  }
  if (t.device().is_cpu() || !t.has_storage()) return nullptr;
  auto it = device_stores_.find(t.storage().unsafeGetStorageImpl());
  if (it == device_stores_.end()) return nullptr;
  if (it->second.first.expired() || is_complete(it->second.second, memo)) {
    device_stores_.erase(it);
    return nullptr;
  }
  return it->second.second;
}

bool Engine::foreign_pinned(const at::Tensor& t) {
  if (!t.has_storage()) return false;
  const c10::Storage& s = t.storage();
  const c10::Allocator* allocator = s.allocator();
  if (allocator != nullptr) {
    if (allocator == c10::GetCPUAllocator() || allocator == c10::GetDefaultCPUAllocator())
      return false;  // pageable (a view made dense by the fetch comes from it too)
    if (allocator == backend_->pinned_host_allocator()) return true;
  }
  const c10::StorageImpl* key = s.unsafeGetStorageImpl();
  const void* data = s.data();
  {
    auto l = lock();
    auto it = pinned_memo_.find(key);
    if (it != pinned_memo_.end() && !it->second.storage.expired() && it->second.data == data)
      return it->second.pinned;
  }
  ++backend_->counters.pinned_queries;
  const bool pinned = backend_->is_pinned(t);  // never a False from before CUDA's lazy init
  auto l = lock();
  // Entries of dead storages go now and then: amortised O(1) per query. Weak references only:
  // no Python object is touched under the lock.
  if (++pinned_memo_inserts_ % 64 == 0) {
    for (auto it = pinned_memo_.begin(); it != pinned_memo_.end();)
      it = it->second.storage.expired() ? pinned_memo_.erase(it) : std::next(it);
  }
  pinned_memo_.insert_or_assign(key, PinnedMemo{s.getWeakStorageImpl(), data, pinned});
  return pinned;
}

void Engine::drop_completed_reads(std::vector<EventPtr>* reads) {
  // As a host block's fences (HostBlock::add_fence): a query that throws keeps every read,
  // which later writes then wait for; none is lost.
  try {
    drop_completed(reads, [this](const EventPtr& e) { return backend_->query(e); });
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): all kept, as above
  }
}

void Engine::pending_reads_of(const at::Tensor& t, std::vector<EventPtr>* out) {
  auto it = device_reads_.find(t.storage().unsafeGetStorageImpl());
  if (it == device_reads_.end()) return;
  auto& reads = it->second.second;
  drop_completed_reads(&reads);
  out->insert(out->end(), reads.begin(), reads.end());
}

void Engine::note_device_access(const at::Tensor& t, const EventPtr& done, bool write) {
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  if (write) {
    device_stores_.insert_or_assign(key, std::make_pair(t.storage().getWeakStorageImpl(), done));
  } else {
    auto it = device_reads_.find(key);
    if (it == device_reads_.end() || it->second.first.expired()) {
      device_reads_.insert_or_assign(
          key, std::make_pair(t.storage().getWeakStorageImpl(), std::vector<EventPtr>{done}));
    } else {
      auto& reads = it->second.second;
      drop_completed_reads(&reads);
      reads.push_back(done);
    }
  }
  // Entries of dead storages go now and then: amortised O(1) per access.
  if (++device_notes_ % 64 != 0) return;
  for (auto it = device_stores_.begin(); it != device_stores_.end();)
    it = it->second.first.expired() ? device_stores_.erase(it) : std::next(it);
  for (auto it = device_reads_.begin(); it != device_reads_.end();)
    it = it->second.first.expired() ? device_reads_.erase(it) : std::next(it);
}

void Engine::wait_stored(const at::Tensor& t) {
  backend_->check_process();
  check_streams();
  EventPtr dep;
  {
    auto l = lock();
    dep = pending_write_of(t);
  }
  if (dep) backend_->sync(dep);
  check_streams();  // the write waited for may have been skipped
}

void Engine::trace_start(c10::Device device) {
  synchronize();  // copies issued before the origin are not part of the trace
  EventPtr origin = backend_->trace_origin(backend_->resolve_device(device));
  backend_->sync(origin);  // no copy may complete before its origin
  auto l = lock();
  trace_.clear();
  trace_origin_ = std::move(origin);
}

std::vector<Engine::TraceRow> Engine::trace_stop() {
  synchronize();  // reaps (and so records) every copy still in flight
  auto l = lock();
  trace_origin_.reset();
  return std::exchange(trace_, {});
}

size_t Engine::reserved_bytes() {
  auto l = lock();
  return arena_.reserved_bytes();
}

size_t Engine::empty_cache() {
  synchronize();
  auto l = lock();
  // The disk tier's empty files and pooled I/O buffers go too (not counted: not pinned).
  if (disk_arena_) disk_arena_->release_empty_chunks();
  bounce_arena_->release_empty_chunks();
  staging_arena_->release_empty_chunks();
  for (const Block& b : bounce_pool_) pageable_.release(b.ptr, b.size);
  bounce_pool_.clear();
  bounce_pool_bytes_ = 0;
  return arena_.release_empty_chunks();
}

EngineStats Engine::stats() {
  backend_->check_process();
  Retire r = retiring();
  reap_locked(r);
  arena_.set_limit(pinned_budget_ - std::min(pinned_budget_, shared_pinned_share()));
  EngineStats s = stats_;
  s.in_flight_bytes = in_flight_.bytes();
  s.pinned_reserved_bytes = arena_.reserved_bytes();
  s.pinned_in_use_bytes = arena_.in_use_bytes();
  s.deferred_bytes = deferred_.bytes();
  s.pinned_limit_bytes = arena_.limit();
  s.dedup_entries = dedup_.size();
  s.lock_waits_over_1ms = lock_waits_over_1ms_.load();
  const Counters& c = backend_->counters;
  s.events_created = c.events_created;
  s.events_recorded = c.events_recorded;
  s.stream_waits = c.stream_waits;
  s.copy_calls = c.copy_calls;
  s.host_callbacks = c.host_callbacks;
  s.pinned_registrations = c.pinned_registrations;
  s.syncs = c.syncs;
  s.event_queries = c.event_queries;
  s.threads_prepared = c.threads_prepared;
  s.chunks_made = c.chunks_made;
  s.chunks_released = c.chunks_released;
  s.chunks_kept_registered = c.chunks_kept_registered;
  s.pinned_queries = c.pinned_queries;
  s.packed_spans = span_tally_->spans;
  s.packed_span_bytes = span_tally_->span_bytes;
  s.packed_output_bytes = span_tally_->output_bytes;
  s.host_limit_bytes = disk_options_.host_limit;
  if (disk_) {
    s.disk_bytes = disk_arena_->in_use_bytes();
    s.disk_reserved_bytes = disk_arena_->reserved_bytes();
    s.disk_files = disk_->files();
  }
  s.bounce_reserved_bytes = bounce_arena_->reserved_bytes();
  s.staging_reserved_bytes = staging_arena_->reserved_bytes();
  if (file_ring_ && file_ring_->chunk == kRingChunk) s.bounce_reserved_bytes += file_ring_->size;
  s.disk_write_bytes = disk_write_bytes_.load();
  s.disk_read_bytes = disk_read_bytes_.load();
  s.disk_write_seconds = static_cast<double>(disk_write_ns_.load()) * 1e-9;
  s.disk_read_seconds = static_cast<double>(disk_read_ns_.load()) * 1e-9;
  s.disk_fallbacks = disk_fallbacks_.load();
  s.file_read_bytes = file_read_bytes_.load();
  s.file_cached_reads = file_cached_reads_.load();
  s.file_buffered_reads = file_buffered_reads_.load();
  s.file_read_seconds = static_cast<double>(file_read_ns_.load()) * 1e-9;
  return s;
}

}  // namespace offcache
