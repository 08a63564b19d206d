#include "engine.h"

#include <algorithm>
#include <cstdlib>

#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

Engine::Engine(std::unique_ptr<Backend> backend, ArenaOptions arena, size_t max_in_flight)
    : backend_(std::move(backend)),
      arena_(backend_->chunks(), arena),
      max_in_flight_(max_in_flight) {}

bool Engine::is_arena_tensor(const at::Tensor& t) const {
  HostBlock* hb = host_block_of(t);
  return hb != nullptr && hb->engine == this && hb->pinned;
}

void Engine::free_block(const Block& block) {
  if (block.chunk == kPageableChunk) {
    pageable_.release(block.ptr, block.size);
    stats_.pageable_bytes -= block.size;
  } else {
    arena_.free(block);
  }
}

void Engine::release(HostBlock* hb) noexcept {
  std::unique_ptr<HostBlock> owned(hb);
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.push(hb->block, std::move(hb->fences));
  deferred_.reclaim([this](const Block& b) { free_block(b); });
}

HostBlock* Engine::allocate_host(size_t bytes, bool allow_spill) {
  deferred_.reclaim([this](const Block& b) { free_block(b); });
  std::string why;
  auto block = arena_.allocate(bytes, &why);
  if (!block && deferred_.size() > 0) {
    // Memory waiting on copies counts as available: wait for them first.
    deferred_.wait_all();
    deferred_.reclaim([this](const Block& b) { free_block(b); });
    block = arena_.allocate(bytes, &why);
  }
  auto hb = std::make_unique<HostBlock>();
  hb->engine = this;
  if (block) {
    hb->block = *block;
    hb->pinned = true;
    return hb.release();
  }
  if (!allow_spill) return nullptr;
  // Past the budget, or the OS refused to pin: spill to pageable memory.
  const size_t size = align_up(std::max<size_t>(bytes, 1), 4096);
  void* p = pageable_.allocate(size, &why);
  TORCH_CHECK(p != nullptr, "offcache: out of host memory for ", bytes, " bytes: ", why);
  hb->block = Block{p, size, kPageableChunk, 0};
  hb->pinned = false;
  stats_.pageable_bytes += size;
  ++stats_.spills;
  if (!spill_warned_) {
    spill_warned_ = true;
    spill_notice_ = "offcache: pinned arena unavailable (" + why +
                    "); spilling to pageable host memory, copies will be slower";
  }
  return hb.release();
}

std::string Engine::take_spill_notice() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(spill_notice_, std::string());
}

void Engine::set_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  arena_.set_limit(bytes);
  spill_warned_ = false;
}

std::vector<Engine::InFlight> Engine::reap_locked() {
  std::vector<InFlight> done;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (it->done->query()) {
      const double seconds = it->start ? it->done->elapsed_ms_since(*it->start) / 1000.0 : 0.0;
      (it->dir == Dir::kStore ? stats_.d2h_seconds : stats_.h2d_seconds) += seconds;
      if (trace_origin_ && it->start) {
        trace_.push_back(TraceRow{it->dir, it->bytes, it->start->elapsed_ms_since(*trace_origin_),
                                  it->done->elapsed_ms_since(*trace_origin_)});
      }
      stats_.in_flight_bytes -= it->bytes;
      done.push_back(std::move(*it));
      it = in_flight_.erase(it);
    } else {
      ++it;
    }
  }
  deferred_.reclaim([this](const Block& b) { free_block(b); });
  return done;
}

void Engine::note_peaks_locked() {
  auto& s = stats_;
  s.peak_pinned_reserved_bytes = std::max(s.peak_pinned_reserved_bytes, arena_.reserved_bytes());
  s.peak_pinned_in_use_bytes = std::max(s.peak_pinned_in_use_bytes, arena_.in_use_bytes());
  s.peak_pageable_bytes = std::max(s.peak_pageable_bytes, s.pageable_bytes);
  s.peak_in_flight_bytes = std::max(s.peak_in_flight_bytes, s.in_flight_bytes);
}

void Engine::throttle(size_t incoming) {
  // Bounds bytes in flight so queued stores cannot pin unbounded GPU memory.
  for (;;) {
    EventPtr oldest;
    std::vector<InFlight> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished = reap_locked();
      if (in_flight_.empty() || stats_.in_flight_bytes + incoming <= max_in_flight_) return;
      oldest = in_flight_.front().done;
    }
    finished.clear();  // tensors die outside the lock
    oldest->wait();
  }
}

EventPtr Engine::issue(Dir dir, c10::Device device, const std::vector<EventPtr>& deps,
                       const std::vector<CopyOp>& ops, size_t bytes,
                       std::vector<at::Tensor> keepalive, std::function<void()> after_copy) {
  throttle(bytes);
  for (const auto& dep : deps) backend_->copy_wait(dir, device, dep);
  EventPtr start = backend_->copy_record(dir, device, /*timed=*/true);
  backend_->copy(dir, device, ops);
  if (after_copy) backend_->host_callback(dir, device, std::move(after_copy));
  EventPtr done = backend_->copy_record(dir, device, /*timed=*/true);
  for (const auto& t : keepalive) {
    if (!t.device().is_cpu()) backend_->mark_used_by_copy(dir, device, t);
  }
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.push_back(InFlight{start, done, bytes, dir, std::move(keepalive)});
  stats_.in_flight_bytes += bytes;
  if (dir == Dir::kStore) {
    stats_.d2h_bytes += bytes;
    stats_.d2h_copies += ops.size();
  } else {
    stats_.h2d_bytes += bytes;
    stats_.h2d_copies += ops.size();
  }
  note_peaks_locked();
  return done;
}

EventPtr Engine::store_event_of(const at::Tensor& t) {
  EventPtr dep;
  if (HostBlock* hb = host_block_of(t)) {
    dep = hb->stored;
  } else if (!t.device().is_cpu() && t.has_storage()) {
    auto it = device_stores_.find(t.storage().unsafeGetStorageImpl());
    if (it != device_stores_.end() && !it->second.first.expired()) dep = it->second.second;
  }
  return dep && dep->query() ? nullptr : dep;
}

Engine::Source Engine::resolve_source(const at::Tensor& t) {
  Source s{t.is_contiguous() ? t : t.contiguous(), nullptr};
  std::lock_guard<std::mutex> lock(mu_);
  s.dep = store_event_of(t);
  return s;
}

void Engine::wait_stored(const at::Tensor& t) {
  EventPtr dep;
  std::shared_ptr<std::atomic<bool>> torn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dep = store_event_of(t);
    if (HostBlock* hb = host_block_of(t)) torn = hb->torn;
  }
  if (dep) dep->wait();
  check_torn({torn});
}

void Engine::wait(const EventPtr& event, c10::Device device) {
  if (event) backend_->current_wait(device, event);
}

void Engine::synchronize() {
  std::vector<EventPtr> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& f : in_flight_) events.push_back(f.done);
  }
  for (auto& e : events) e->wait();
  std::vector<InFlight> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished = reap_locked();
    deferred_.wait_all();
    deferred_.reclaim([this](const Block& b) { free_block(b); });
  }
}

void Engine::trace_start(c10::Device device) {
  synchronize();  // copies issued before the origin are not part of the trace
  EventPtr origin = backend_->trace_origin(backend_->resolve_device(device));
  std::lock_guard<std::mutex> lock(mu_);
  trace_.clear();
  trace_origin_ = std::move(origin);
}

std::vector<Engine::TraceRow> Engine::trace_stop() {
  synchronize();  // reaps (and so records) every copy still in flight
  std::lock_guard<std::mutex> lock(mu_);
  trace_origin_.reset();
  return std::exchange(trace_, {});
}

size_t Engine::empty_cache() {
  synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  return arena_.release_empty_chunks();
}

EngineStats Engine::stats() {
  std::vector<InFlight> finished;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  finished = reap_locked();
  EngineStats s = stats_;
  s.pinned_reserved_bytes = arena_.reserved_bytes();
  s.pinned_in_use_bytes = arena_.in_use_bytes();
  s.deferred_bytes = deferred_.bytes();
  s.pinned_limit_bytes = arena_.limit();
  s.dedup_entries = dedup_.size();
  return s;
}

}  // namespace offcache
