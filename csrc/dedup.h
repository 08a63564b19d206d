// Tensor-identity dedup table. The key is the source TensorImpl, held
// weakly so the entry dies with the tensor. An entry is a candidate only
// while the source is unchanged as far as torch can tell (same version
// counter, storage, data pointer, dtype, sizes, strides and requires_grad)
// and the stored copy was not edited (its version counter). The engine then
// compares the bytes of CPU sources, which catches writes that bump nothing
// (through .data, another alias, numpy); for GPU sources it cannot look.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <unordered_map>
#include <vector>

namespace offcache {

class DedupTable {
 public:
  // A rejected candidate goes to `dropped`: the caller destroys it unlocked
  // (a tensor's destructor may need the GIL).
  std::optional<at::Tensor> find(const at::Tensor& source, c10::Device target,
                                 std::vector<at::Tensor>& dropped);
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
  static bool matches(const Entry& e, const at::Tensor& source);
  void sweep();
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t inserts_since_sweep_ = 0;
  size_t live_after_sweep_ = 0;
};

}  // namespace offcache
