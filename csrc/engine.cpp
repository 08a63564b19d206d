#include "engine.h"

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cstdlib>

namespace offcache {
namespace {

// Values below this size that are stored together share one block and one
// copy; on fetch they land in one device buffer with one copy.
constexpr size_t kPackBytes = size_t{1} << 20;
constexpr size_t kPackAlign = 64;  // >= every dtype's alignment

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// A contiguous tensor of `dtype`/`sizes` viewing `storage` at `byte_offset`.
at::Tensor view_of(const c10::Storage& storage, size_t byte_offset, const at::Tensor& like) {
  const c10::DispatchKey key =
      storage.device().is_cpu() ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  auto* impl = t.unsafeGetTensorImpl();
  TORCH_INTERNAL_ASSERT(byte_offset % like.element_size() == 0);
  impl->set_sizes_contiguous(like.sizes());
  impl->set_storage_offset(static_cast<int64_t>(byte_offset / like.element_size()));
  if (like.requires_grad()) t.set_requires_grad(true);
  return t;
}

void check_storable(const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), "offcache: cannot store an undefined tensor");
  TORCH_CHECK_TYPE(t.layout() == c10::kStrided, "offcache: cannot store a tensor with layout ",
                   t.layout(), "; only strided (dense) tensors are supported");
  TORCH_CHECK_TYPE(!t.is_quantized(), "offcache: cannot store a quantized tensor");
  TORCH_CHECK_TYPE(!t.is_nested(), "offcache: cannot store a nested tensor");
  TORCH_CHECK_VALUE(!t.is_meta(), "offcache: cannot store a meta tensor: it has no data");
}

// The GPU whose copy stream moves data between `a` and `b` (CPU if neither).
c10::Device stream_device(c10::Device preferred, c10::Device other) {
  return preferred.is_cpu() ? other : preferred;
}

}  // namespace

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

std::vector<at::Tensor> Engine::store(const std::vector<at::Tensor>& values, c10::Device target,
                                      bool allow_spill) {
  target = backend_->resolve_device(target);
  for (const auto& v : values) {
    check_storable(v);
    backend_->resolve_device(v.device());
  }
  std::vector<at::Tensor> out(values.size());
  std::vector<size_t> misses;
  std::unordered_map<const c10::TensorImpl*, size_t> first;  // repeats within this call
  std::vector<std::pair<size_t, size_t>> repeats;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.stores;
    for (size_t i = 0; i < values.size(); ++i) {
      const at::Tensor& v = values[i];
      if (auto hit = dedup_.find(v, target)) {
        out[i] = std::move(*hit);
        ++stats_.dedup_hits;
      } else if (auto it = first.find(v.unsafeGetTensorImpl()); it != first.end()) {
        repeats.emplace_back(i, it->second);
        ++stats_.dedup_hits;
      } else {
        first.emplace(v.unsafeGetTensorImpl(), i);
        misses.push_back(i);
      }
    }
  }
  if (target.is_cpu()) {
    std::vector<at::Tensor> sources;
    for (size_t i : misses) sources.push_back(values[i]);
    std::vector<bool> stored;
    auto copies = store_to_host(sources, allow_spill, &stored);
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < misses.size(); ++k) {
      out[misses[k]] = std::move(copies[k]);
      if (stored[k]) dedup_.insert(values[misses[k]], out[misses[k]], target);
    }
  } else {
    for (size_t i : misses) {
      out[i] = values[i].device() == target ? values[i] : store_to_device(values[i], target);
      std::lock_guard<std::mutex> lock(mu_);
      if (!out[i].is_same(values[i])) dedup_.insert(values[i], out[i], target);
    }
  }
  for (auto [i, j] : repeats) out[i] = out[j];
  return out;
}

std::vector<at::Tensor> Engine::store_to_host(const std::vector<at::Tensor>& values,
                                              bool allow_spill, std::vector<bool>* stored) {
  std::vector<at::Tensor> out(values.size());
  stored->assign(values.size(), false);
  // Group by source device: each group is one batch on that device's D2H stream.
  std::vector<c10::Device> devices;
  for (const auto& v : values) {
    if (std::find(devices.begin(), devices.end(), v.device()) == devices.end()) {
      devices.push_back(v.device());
    }
  }
  for (c10::Device device : devices) {
    std::vector<size_t> small, large;
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i].device() != device) continue;
      if (values[i].numel() == 0) {
        out[i] = at::empty(values[i].sizes(), values[i].options().device(c10::kCPU));
        (*stored)[i] = true;
      } else {
        (values[i].nbytes() < kPackBytes ? small : large).push_back(i);
      }
    }
    // Layout: one packed block for the small values, one block per large value.
    std::vector<std::vector<size_t>> groups;
    if (!small.empty()) groups.push_back(small);
    for (size_t i : large) groups.push_back({i});

    std::vector<CopyOp> ops;
    std::vector<EventPtr> deps;
    std::vector<at::Tensor> keepalive;
    std::vector<HostBlock*> blocks;
    // Sources the copy reads directly, with their versions: an in-place edit
    // enqueued before the copy finished may tear the stored copy.
    std::vector<std::pair<const c10::TensorImpl*, uint32_t>> watched;
    auto torn = std::make_shared<std::atomic<bool>>(false);
    size_t bytes = 0;
    for (const auto& group : groups) {
      std::vector<size_t> offsets;
      size_t total = 0;
      for (size_t i : group) {
        offsets.push_back(total);
        total = align_up(total + values[i].nbytes(), kPackAlign);
      }
      HostBlock* hb;
      {
        std::lock_guard<std::mutex> lock(mu_);
        hb = allocate_host(total, allow_spill);
        note_peaks_locked();
      }
      if (hb == nullptr) {  // arena full and spilling not allowed: keep as is
        for (size_t i : group) out[i] = values[i];
        continue;
      }
      blocks.push_back(hb);
      c10::Storage storage = make_host_storage(hb);
      for (size_t k = 0; k < group.size(); ++k) {
        const size_t i = group[k];
        Source src = resolve_source(values[i]);
        if (src.dep) deps.push_back(src.dep);
        if (src.tensor.is_same(values[i]) && !values[i].is_inference()) {
          const auto* impl = values[i].unsafeGetTensorImpl();
          watched.emplace_back(impl, impl->version_counter().current_version());
        }
        ops.push_back(CopyOp{static_cast<char*>(hb->block.ptr) + offsets[k], src.tensor.data_ptr(),
                             values[i].nbytes()});
        bytes += values[i].nbytes();
        keepalive.push_back(std::move(src.tensor));
        out[i] = view_of(storage, offsets[k], values[i]);
        (*stored)[i] = true;
      }
    }
    if (ops.empty()) continue;
    // Producer stream -> event -> D2H copy stream.
    deps.push_back(backend_->record_current(device));
    // The sources stay alive (keepalive) until `done`, which follows the check.
    auto check = [watched = std::move(watched), torn] {
      for (const auto& [impl, version] : watched) {
        if (impl->version_counter().current_version() != version) torn->store(true);
      }
    };
    EventPtr done = issue(Dir::kStore, stream_device(device, c10::kCPU), deps, ops, bytes,
                          std::move(keepalive), std::move(check));
    std::lock_guard<std::mutex> lock(mu_);
    for (HostBlock* hb : blocks) {
      hb->stored = done;
      hb->torn = torn;
      hb->fences.push_back(done);
    }
  }
  return out;
}

at::Tensor Engine::store_to_device(const at::Tensor& value, c10::Device target) {
  // Offload to another GPU: a peer copy on the source device's D2H stream.
  Source src = resolve_source(value);
  at::Tensor dst = at::empty(value.sizes(), value.options().device(target));
  // The copy waits for the producer, and for work already queued on the target's
  // stream: `dst` came from that stream's pool, where freed memory may still be in use.
  std::vector<EventPtr> deps{backend_->record_current(value.device()),
                             backend_->record_current(target)};
  if (src.dep) deps.push_back(src.dep);
  if (value.numel() == 0) return dst;
  const c10::Device device = stream_device(value.device(), target);
  EventPtr done = issue(Dir::kStore, device, deps,
                        {CopyOp{dst.data_ptr(), src.tensor.data_ptr(), value.nbytes()}},
                        value.nbytes(), {src.tensor, dst});
  if (value.requires_grad()) dst.set_requires_grad(true);
  std::lock_guard<std::mutex> lock(mu_);
  device_stores_.insert_or_assign(dst.storage().unsafeGetStorageImpl(),
                                  std::make_pair(dst.storage().getWeakStorageImpl(), done));
  for (auto it = device_stores_.begin(); it != device_stores_.end();) {
    it = it->second.first.expired() ? device_stores_.erase(it) : std::next(it);
  }
  return dst;
}

void Engine::check_torn(const std::vector<std::shared_ptr<std::atomic<bool>>>& flags) {
  for (const auto& f : flags) {
    TORCH_CHECK(!f || !f->load(),
                "offcache: a tensor was modified in place while its store (D2H copy) was in "
                "flight, so its stored copy may be torn. Wait for stores to finish "
                "(offcache.synchronize()) before editing a stored tensor in place.");
  }
}

Engine::Fetched Engine::fetch(const std::vector<at::Tensor>& stored, c10::Device device,
                              bool wait) {
  device = backend_->resolve_device(device);
  std::vector<at::Tensor> out(stored.size());
  std::vector<Source> sources(stored.size());
  std::vector<HostBlock*> blocks(stored.size(), nullptr);
  for (size_t i = 0; i < stored.size(); ++i) {
    TORCH_CHECK_TYPE(stored[i].defined() && stored[i].layout() == c10::kStrided,
                     "offcache: can only fetch dense tensors");
    // Already where it is wanted and not arena memory: no copy, like Tensor.to().
    if (stored[i].device() == device && host_block_of(stored[i]) == nullptr) {
      out[i] = stored[i];
      continue;
    }
    backend_->resolve_device(stored[i].device());
    if (stored[i].numel() == 0) {
      out[i] = at::empty(stored[i].sizes(), stored[i].options().device(device));
      continue;
    }
    sources[i] = resolve_source(stored[i]);
    if (sources[i].tensor.is_same(stored[i])) blocks[i] = host_block_of(stored[i]);
  }

  // Destination layout. Values from one packed host block keep their relative
  // offsets, so the whole span moves in one copy; large values get their own
  // buffer so the consumer can free them one by one.
  struct Segment {
    const char* src_begin;
    size_t length;
    size_t payload;  // bytes of the items (length minus gaps)
    std::vector<size_t> items;
    size_t offset = 0;  // in the shared small buffer
    bool own = false;
  };
  std::vector<Segment> segments;
  std::unordered_map<HostBlock*, size_t> by_block;
  for (size_t i = 0; i < stored.size(); ++i) {
    if (!sources[i].tensor.defined()) continue;
    const auto* p = static_cast<const char*>(sources[i].tensor.data_ptr());
    const size_t n = stored[i].nbytes();
    auto it = blocks[i] ? by_block.find(blocks[i]) : by_block.end();
    if (it != by_block.end()) {
      Segment& s = segments[it->second];
      const char* lo = std::min(s.src_begin, p);
      const size_t hi = std::max<size_t>(s.src_begin + s.length - lo, p + n - lo);
      if (hi <= 2 * (s.payload + n) + 4096) {  // dense enough to copy the span, gaps included
        s.src_begin = lo;
        s.length = hi;
        s.payload += n;
        s.items.push_back(i);
        continue;
      }
    }
    segments.push_back(Segment{p, n, n, {i}, 0, n >= kPackBytes});
    if (blocks[i] && n < kPackBytes) by_block[blocks[i]] = segments.size() - 1;
  }
  size_t small_total = 0;
  for (auto& s : segments) {
    if (s.own) continue;
    s.offset = small_total;
    small_total = align_up(small_total + s.length, 256);
  }
  const auto byte_options = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor small_buffer;
  if (small_total > 0) small_buffer = at::empty({static_cast<int64_t>(small_total)}, byte_options);

  std::vector<CopyOp> ops;
  std::vector<EventPtr> deps;
  std::vector<at::Tensor> keepalive;
  size_t bytes = 0;
  for (auto& s : segments) {
    at::Tensor buffer =
        s.own ? at::empty({static_cast<int64_t>(s.length)}, byte_options) : small_buffer;
    char* base = static_cast<char*>(buffer.data_ptr()) + s.offset;
    ops.push_back(CopyOp{base, s.src_begin, s.length});
    bytes += s.length;
    for (size_t i : s.items) {
      const auto* p = static_cast<const char*>(sources[i].tensor.data_ptr());
      out[i] = view_of(buffer.storage(), s.offset + (p - s.src_begin), stored[i]);
      if (sources[i].dep) deps.push_back(sources[i].dep);
      keepalive.push_back(sources[i].tensor);
    }
    if (s.own) keepalive.push_back(std::move(buffer));
  }
  if (small_buffer.defined()) keepalive.push_back(small_buffer);
  EventPtr done;
  if (!ops.empty()) {
    // Store events -> H2D copy stream; the consumer waits on `done` below or in wait().
    // The buffers came from the consumer stream's pool, where memory freed by the
    // consumer may still be read by its queued kernels: the copy waits for those too.
    deps.push_back(backend_->record_current(device));
    const c10::Device copy_device = stream_device(device, stored.front().device());
    done = issue(Dir::kFetch, copy_device, deps, ops, bytes, std::move(keepalive));
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.fetches;
    for (HostBlock* hb : blocks) {
      if (hb == nullptr) continue;
      auto& f = hb->fences;
      f.erase(std::remove_if(f.begin(), f.end(), [](const EventPtr& e) { return e->query(); }),
              f.end());
      f.push_back(done);
    }
  }
  std::vector<std::shared_ptr<std::atomic<bool>>> torn;
  for (HostBlock* hb : blocks) {
    if (hb != nullptr && hb->torn) torn.push_back(hb->torn);
  }
  if (wait && done) {
    backend_->current_wait(device, done);
    check_torn(torn);
  }
  return {std::move(out), done, std::move(torn)};
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
