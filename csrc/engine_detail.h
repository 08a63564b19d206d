// Helpers shared by the engine's translation units (store, fetch, lifecycle).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

namespace offcache::detail {

// Values below this size that are stored together share one block and one
// copy; on fetch they land in one device buffer with one copy.
constexpr size_t kPackBytes = size_t{1} << 20;
constexpr size_t kPackAlign = 64;  // >= every dtype's alignment

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// A contiguous tensor of `dtype`/`sizes` viewing `storage` at `byte_offset`.
inline at::Tensor view_of(const c10::Storage& storage, size_t byte_offset, const at::Tensor& like) {
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

inline void check_storable(const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), "offcache: cannot store an undefined tensor");
  TORCH_CHECK_TYPE(t.layout() == c10::kStrided, "offcache: cannot store a tensor with layout ",
                   t.layout(), "; only strided (dense) tensors are supported");
  TORCH_CHECK_TYPE(!t.is_quantized(), "offcache: cannot store a quantized tensor");
  TORCH_CHECK_TYPE(!t.is_nested(), "offcache: cannot store a nested tensor");
  TORCH_CHECK_VALUE(!t.is_meta(), "offcache: cannot store a meta tensor: it has no data");
}

// The GPU whose copy stream moves data between `a` and `b` (CPU if neither).
inline c10::Device stream_device(c10::Device preferred, c10::Device other) {
  return preferred.is_cpu() ? other : preferred;
}

}  // namespace offcache::detail
