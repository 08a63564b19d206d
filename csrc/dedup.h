// Tensor-identity dedup table. The key is the source TensorImpl, held
// weakly so the entry dies with the tensor. An entry is valid only while the
// source's version counter is unchanged: a tensor edited in place after it
// was stored is copied again rather than served stale.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <unordered_map>

namespace offcache {

class DedupTable {
 public:
  std::optional<at::Tensor> find(const at::Tensor& source, c10::Device target);
  void insert(const at::Tensor& source, const at::Tensor& stored, c10::Device target);
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> source;
    c10::weak_intrusive_ptr<c10::TensorImpl> stored;
    uint32_t version;
    c10::Device target;
  };
  void sweep();
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t inserts_since_sweep_ = 0;
  size_t live_after_sweep_ = 0;
};

}  // namespace offcache
