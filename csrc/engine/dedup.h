// Tensor-identity dedup table. The key is the source TensorImpl, held
// weakly so the entry dies with the tensor. An entry is a candidate only
// while the source is unchanged as far as torch can tell (same version
// counter, storage, data pointer, dtype, sizes, strides and requires_grad)
// and the stored copy was not edited (its version counter). The engine then
// compares the bytes of CPU sources, which catches writes that bump nothing
// (through .data, another alias, numpy); for GPU sources it cannot look.
//
// The table lives under the engine lock and never takes a strong reference:
// it hands out candidates (weak references) and take() turns one into the
// stored tensor after the lock is released. A strong reference made from a
// weak one, and its release, may call into Python (torch increfs a tensor's
// Python object when its only owner was that object, which needs the GIL),
// and the engine lock is never held while waiting for the GIL (engine.h).
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <unordered_map>
#include <vector>

namespace offcache {

class DedupTable {
 public:
  // A live entry's stored copy, held weakly, with its version when stored.
  struct Candidate {
    c10::weak_intrusive_ptr<c10::TensorImpl> stored;
    uint32_t stored_version;
  };
  // Under the engine lock: the entry for `source` if it may still be a hit.
  // Copies a weak reference only (no Python).
  std::optional<Candidate> candidate(const at::Tensor& source, c10::Device target) const;
  // Without the engine lock: the candidate's stored copy, or nullopt when it
  // died or was edited. An edited copy goes to `dropped`: the caller lets it
  // die unlocked too.
  static std::optional<at::Tensor> take(const Candidate& c, std::vector<at::Tensor>& dropped);
  // Under the engine lock again: whether `stored` (from take()) is still the
  // live entry for `source`, both unchanged.
  bool confirm(const at::Tensor& source, c10::Device target, const at::Tensor& stored) const;
  void insert(const at::Tensor& source, const at::Tensor& stored, c10::Device target);
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> source;
    c10::weak_intrusive_ptr<c10::TensorImpl> stored;
    uint32_t version, stored_version;
    const c10::StorageImpl* storage;
    const void* data;
    caffe2::TypeMeta dtype;
    std::vector<int64_t> sizes, strides;
    bool requires_grad;
    c10::Device target;
  };
  const Entry* live_entry(const at::Tensor& source, c10::Device target) const;
  static bool matches(const Entry& e, const at::Tensor& source);
  void sweep();
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t inserts_since_sweep_ = 0;
  size_t live_after_sweep_ = 0;
};

}  // namespace offcache
