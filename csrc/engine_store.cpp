// Engine::store: D2H into the pinned arena (or a peer GPU), deduplicated.
#include <algorithm>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

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

}  // namespace offcache
