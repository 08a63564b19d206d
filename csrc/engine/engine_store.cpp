// Engine::store: a snapshot on the producer's stream, drained D2H into the
// pinned arena (or copied to a peer GPU), deduplicated.
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

std::vector<at::Tensor> Engine::store(const std::vector<at::Tensor>& values, c10::Device target,
                                      bool allow_spill) {
  check_streams();
  target = backend_->resolve_device(target);
  std::vector<c10::Device> resolved{target};
  for (const auto& v : values) {
    check_storable(v);
    resolve_once(v.device(), &resolved);
  }
  // Repeats within this call share their first occurrence's result.
  std::vector<at::Tensor> out(values.size());
  std::vector<size_t> firsts;
  std::vector<std::pair<size_t, size_t>> repeats;
  {
    std::unordered_map<const c10::TensorImpl*, size_t> first;
    for (size_t i = 0; i < values.size(); ++i) {
      auto [it, fresh] = first.emplace(values[i].unsafeGetTensorImpl(), i);
      if (fresh) {
        firsts.push_back(i);
      } else {
        repeats.emplace_back(i, it->second);
      }
    }
  }
  // Dedup. The table is read under the lock, but the stored copies are taken
  // (a strong reference, which may need the GIL) after it, and confirmed under
  // it again: the lock is never held while waiting for the GIL (engine.h).
  // Everything let go of here dies unlocked, at the end of the call.
  std::vector<at::Tensor> dropped;
  std::vector<std::pair<size_t, DedupTable::Candidate>> candidates;
  {
    auto l = lock();
    ++stats_.stores;
    stats_.dedup_hits += repeats.size();
    for (size_t i : firsts) {
      if (auto c = dedup_.candidate(values[i], target)) candidates.emplace_back(i, std::move(*c));
    }
  }
  std::vector<std::pair<size_t, at::Tensor>> hits;
  for (const auto& [i, c] : candidates) {
    if (auto hit = DedupTable::take(c, dropped)) hits.emplace_back(i, std::move(*hit));
  }
  if (!hits.empty()) {
    // A CPU hit is compared byte for byte with its stored copy, which must be
    // written first: copies still writing one are waited for (unlocked) once.
    for (bool waited = false;;) {
      std::vector<EventPtr> writes;
      {
        auto l = lock();
        for (auto& [i, hit] : hits) {
          if (!hit.defined()) continue;
          if (!dedup_.confirm(values[i], target, hit)) {
            dropped.push_back(std::move(hit));
          } else if (!waited && values[i].device().is_cpu()) {
            if (EventPtr e = pending_write_of(hit)) writes.push_back(std::move(e));
          }
        }
        if (writes.empty()) {
          for (auto& [i, hit] : hits) {
            if (!hit.defined()) continue;
            if (same_bytes(values[i], hit)) {
              out[i] = std::move(hit);
              ++stats_.dedup_hits;
            } else {
              dropped.push_back(std::move(hit));
            }
          }
          break;
        }
      }
      for (const auto& e : writes) backend_->sync(e);
      waited = true;
    }
  }
  std::vector<size_t> misses;
  for (size_t i : firsts) {
    if (!out[i].defined()) misses.push_back(i);
  }
  if (target.is_cpu()) {
    std::vector<at::Tensor> sources;
    for (size_t i : misses) sources.push_back(values[i]);
    std::vector<bool> stored;
    auto copies = store_to_host(sources, allow_spill, &stored);
    auto l = lock();
    for (size_t k = 0; k < misses.size(); ++k) {
      out[misses[k]] = std::move(copies[k]);
      if (stored[k]) dedup_.insert(values[misses[k]], out[misses[k]], target);
    }
  } else {
    for (size_t i : misses) {
      out[i] = store_to_device(values[i], target);
      auto l = lock();
      dedup_.insert(values[i], out[i], target);
    }
  }
  for (auto [i, j] : repeats) out[i] = out[j];
  return out;
}

bool Engine::same_bytes(const at::Tensor& source, const at::Tensor& stored) {
  if (!source.device().is_cpu()) return true;  // a GPU source cannot be read here
  // A CPU source is compared with its stored copy, once that copy is written:
  // writes that bump no version counter are seen too.
  if (pending_write_of(stored) || source.is_conj() || source.is_neg() || !dense(source) ||
      stored.nbytes() != source.nbytes()) {
    return false;
  }
  return std::memcmp(source.data_ptr(), stored.data_ptr(), source.nbytes()) == 0;
}

namespace {

// One value's part in a store: its materialised source and where it goes.
struct Item {
  size_t index;      // into the store's values
  at::Tensor dense;  // conj/neg resolved, dense (the value itself when it already was)
  bool fresh;        // `dense` is a private copy: already a snapshot
  size_t offset;     // in its host block
};

// Copies a group's bytes to `base` (memory on `device`) at their offsets, now
// in the producer's order: a memcpy by this thread for a CPU producer, one
// batched kernel on the current stream for a GPU.
void snapshot_into(char* base, const std::vector<Item>& group, c10::Device device) {
  if (device.is_cpu()) {
    for (const Item& it : group)
      std::memcpy(base + it.offset, it.dense.data_ptr(), it.dense.nbytes());
    return;
  }
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
  std::vector<at::Tensor> dst, src;
  for (const Item& it : group) {
    dst.push_back(at::for_blob(base + it.offset, {static_cast<int64_t>(it.dense.nbytes())})
                      .options(bytes)
                      .target_device(device)
                      .make_tensor());
    src.push_back(bytes_of(it.dense));
  }
  at::_foreach_copy_(dst, src);
}

}  // namespace

at::Tensor Engine::staging_buffer(size_t bytes, c10::Device device) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  if (!device.is_cpu()) return at::empty({static_cast<int64_t>(bytes)}, options);
  // Host snapshots are staged in the arena: pre-faulted pages, reused, instead
  // of fresh pages (a page fault each) from malloc for every store.
  // Undefined where the host limit leaves no room for it (after waiting for the
  // staging of earlier stores): the caller copies from the sources instead.
  HostBlock* hb = allocate_host(bytes, /*allow_spill=*/true, /*staging=*/true);
  if (hb == nullptr) return at::Tensor();
  return at::empty({0}, options)
      .set_(make_host_storage(hb, 0, bytes), 0, {static_cast<int64_t>(bytes)}, {1});
}

std::vector<at::Tensor> Engine::store_to_host(const std::vector<at::Tensor>& values,
                                              bool allow_spill, std::vector<bool>* stored) {
  std::vector<at::Tensor> out(values.size());
  stored->assign(values.size(), false);
  // Group by source device: each group is snapshotted on that device's current
  // stream and drained on its D2H stream.
  std::vector<c10::Device> devices;
  for (const auto& v : values) {
    if (std::find(devices.begin(), devices.end(), v.device()) == devices.end()) {
      devices.push_back(v.device());
    }
  }
  for (c10::Device device : devices) {
    // A source still being written by an earlier offcache copy is read only after it.
    std::vector<EventPtr> pending;
    {
      auto l = lock();
      QueryMemo memo;
      for (const auto& v : values) {
        if (v.device() != device) continue;
        if (EventPtr e = pending_write_of(v, &memo)) pending.push_back(std::move(e));
      }
    }
    for (const auto& e : pending) backend_->current_wait(device, e);

    // Layout: small values packed into blocks of at most kPackPieceBytes; one block per large
    // value.
    std::vector<std::vector<Item>> groups;
    std::vector<Item> small;
    size_t piece = 0;
    auto close_piece = [&] {
      if (!small.empty()) groups.push_back(std::move(small));
      small.clear();
      piece = 0;
    };
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i].device() != device) continue;
      at::Tensor d = materialized(values[i]);
      if (d.numel() == 0) {
        out[i] = keep_flags(empty_like_on(d, c10::kCPU), values[i]);
        (*stored)[i] = true;
        continue;
      }
      Item item{i, d, !d.is_alias_of(values[i]), 0};
      const size_t n = d.nbytes();
      if (n >= kPackBytes) {
        groups.push_back({std::move(item)});
        continue;
      }
      if (piece + n > kPackPieceBytes) close_piece();
      item.offset = piece;
      piece = align_up(piece + n, kPackAlign);
      small.push_back(std::move(item));
    }
    close_piece();

    for (auto& group : groups) {
      const Item& last = group.back();
      const size_t total = last.offset + last.dense.nbytes();
      // A copy stream writes the block unless this thread does (a CPU source stored inline):
      // then it may be a dropped value's block still in flight, written behind its copies.
      const bool stream_written = !(device.is_cpu() && backend_->copies_host_stores_inline());
      std::vector<EventPtr> write_after;
      HostBlock* hb = allocate_host(total, allow_spill, /*staging=*/false,
                                    stream_written ? &write_after : nullptr);
      if (hb == nullptr) {  // arena full and spilling not allowed: keep as is
        for (const Item& it : group) out[it.index] = values[it.index];
        continue;
      }
      for (const Item& it : group) {
        c10::Storage storage = make_host_storage(hb, it.offset, it.dense.nbytes());
        out[it.index] = keep_flags(view_of(storage, 0, it.dense), values[it.index]);
        (*stored)[it.index] = true;
      }
      if (device.is_cpu() && !hb->disk() && backend_->copies_host_stores_inline()) {
        // From CPU memory into a host block: this thread's copy is the snapshot
        // and the store at once. The block is new, so no copy touches it.
        // Timed as a stream's copy batch is (d2h_seconds, a trace's d2h row):
        // the two host events die after the lock below is released.
        const auto start = HostEvent::completed();
        snapshot_into(static_cast<char*>(hb->block.ptr), group, device);
        const auto done = HostEvent::completed();
        auto l = lock();
        stats_.d2h_bytes += total;
        ++stats_.d2h_copies;  // one block's copy, as on a stream
        stats_.inline_store_copies += group.size();
        const double ms = done->elapsed_ms_since(*start);
        if (timing_) stats_.d2h_seconds += ms / 1000.0;
        if (trace_origin_ && dynamic_cast<HostEvent*>(trace_origin_.get()) != nullptr) {
          trace_.push_back(TraceRow{Dir::kStore, total, start->elapsed_ms_since(*trace_origin_),
                                    done->elapsed_ms_since(*trace_origin_)});
        }
        continue;
      }
      throttle(total, Dir::kStore);  // staging memory is bounded by the in-flight bound
      // A disk block: the copy fills an aligned bounce buffer, which the I/O
      // thread then writes to the block's file. Until that write is queued the
      // buffer is this call's to free (a failed copy was waited for by issue()).
      char* dst_base = static_cast<char*>(hb->block.ptr);
      Block bounce;
      if (hb->disk()) bounce = allocate_bounce(align_up(total, kDiskAlign), &dst_base);
      struct BounceGuard {
        Engine* engine;
        Block* bounce;
        ~BounceGuard() {
          if (bounce->ptr == nullptr) return;
          auto l = engine->lock();
          engine->free_block(*bounce);
        }
      } guard{this, &bounce};
      if (hb->disk() && device.is_cpu()) {
        // From the CPU to disk: the copy into the bounce buffer, made now by
        // this thread, is the snapshot; the I/O thread writes it out.
        snapshot_into(dst_base, group, device);
        EventPtr written =
            write_to_disk(hb, std::exchange(bounce, Block{}), dst_base, total, nullptr);
        auto l = lock();
        stats_.d2h_bytes += total;
        stats_.d2h_copies += group.size();
        hb->stored = written;
        hb->add_fence(written);
        continue;
      }
      // Snapshot: the group's bytes, laid out like the block, copied now in the
      // producer's stream order (on the CPU, by this thread). A value that is a
      // private copy already (resolved or made dense) needs none when alone.
      std::vector<at::Tensor> keepalive;
      std::vector<CopyOp> ops;
      bool direct = false;  // no staging memory: the producer waits for the copy instead
      if (group.size() == 1 && group[0].fresh) {
        keepalive.push_back(group[0].dense);
      } else {
        // After a device OOM, staging of that size or more is not tried for a
        // while: each failed attempt makes the caching allocator free its cache
        // (a device-wide sync), and near the memory limit every store would.
        bool skip = false;
        if (!device.is_cpu()) {
          auto l = lock();
          auto it = staging_oom_.find(device.index());
          skip = it != staging_oom_.end() && total >= it->second.first &&
                 std::chrono::steady_clock::now() < it->second.second;
          if (skip) ++stats_.snapshot_oom_skips;
        }
        bool oom = false, no_room = false;
        if (!skip) {
          try {
            at::Tensor staging = staging_buffer(total, device);
            if (staging.defined()) {
              snapshot_into(static_cast<char*>(staging.data_ptr()), group, device);
              keepalive.push_back(std::move(staging));
              auto l = lock();
              stats_.snapshot_bytes += total;
            } else {
              no_room = true;  // host staging would cross the host limit
            }
          } catch (const c10::OutOfMemoryError&) {
            oom = true;
          }
        }
        if (skip || oom || no_room) {  // the copy reads the sources; the producer waits below
          direct = true;
          for (const Item& it : group) keepalive.push_back(it.dense);
          auto l = lock();
          ++stats_.snapshot_fallbacks;
          if (oom && !device.is_cpu()) {
            staging_oom_.insert_or_assign(
                device.index(),
                std::make_pair(total, std::chrono::steady_clock::now() + kStagingOomBackoff));
          }
        }
      }
      if (keepalive.size() == 1 && !direct) {
        const at::Tensor& k = keepalive[0];
        ops.push_back(CopyOp{dst_base, k.data_ptr(), k.nbytes()});
      } else {
        for (const Item& it : group) {
          ops.push_back(CopyOp{dst_base + it.offset, it.dense.data_ptr(), it.dense.nbytes()});
        }
      }
      // Producer stream -> event -> D2H copy stream, behind the copies still touching a
      // reused block (on this stream they are already ahead of it).
      CopyStream& stream = backend_->copy_stream(Dir::kStore, device);
      write_after.push_back(backend_->record_current(device));
      EventPtr done = issue(Dir::kStore, stream, write_after, ops, hold(std::move(keepalive)));
      // A device's copy into pageable memory (a spilled block, a pageable bounce
      // buffer) returns only once it is done: the caller waited for it.
      const bool dst_pinned =
          backend_->chunks().pinned() && (hb->disk() ? from_bounce_arena(bounce) : hb->pinned());
      if (!device.is_cpu() && !dst_pinned) ++backend_->counters.syncs;
      // Without a snapshot, later work on the producer stream may not touch the
      // sources before the copy has read them.
      if (direct) backend_->current_wait(device, done);
      if (hb->disk())
        done = write_to_disk(hb, std::exchange(bounce, Block{}), dst_base, total, done);
      auto l = lock();
      hb->stored = done;
      hb->add_fence(done);
    }
  }
  return out;
}

at::Tensor Engine::store_to_device(const at::Tensor& value, c10::Device target) {
  // Offload to a GPU: a snapshot, then (to another GPU) a peer copy on the
  // source device's D2H stream.
  EventPtr pending;
  {
    auto l = lock();
    pending = pending_write_of(value);
  }
  backend_->current_wait(value.device(), pending);
  at::Tensor src = materialized(value.detach());
  if (src.is_alias_of(value)) src = src.clone(at::MemoryFormat::Preserve);  // the snapshot
  if (value.device() == target) return keep_flags(src, value);
  at::Tensor dst = empty_like_on(src, target);
  if (value.numel() == 0) return keep_flags(dst, value);
  backend_->enable_peer_access(value.device(), target);
  const c10::Device device = stream_device(value.device(), target);
  // The copy waits for the producer, and for work already queued on the target's
  // stream: `dst` came from that stream's pool, where freed memory may still be in use.
  EventPtr done =
      issue(Dir::kStore, backend_->copy_stream(Dir::kStore, device),
            {backend_->record_current(value.device()), backend_->record_current(target)},
            {CopyOp{dst.data_ptr(), src.data_ptr(), src.nbytes()}}, hold({src, dst}));
  keep_flags(dst, value);
  auto l = lock();
  note_device_access(dst, done, /*write=*/true);
  return dst;
}

}  // namespace offcache
