// Helpers shared by the engine's translation units: batching policy, the
// layout of stored tensors, and the rules for what can be stored.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <utility>

namespace offcache::detail {

// Batching policy, owned by the engine. Values below kPackBytes stored
// together share one block (and one copy), in pieces of at most
// kPackPieceBytes, each at a kPackAlign offset. A fetch copies a block's span,
// gaps included, into one allocation that its values' outputs share, while the
// span is at most twice the payload plus kSpanSlack, and at most kSpanFloor
// bytes or kSpanRatio times its smallest value (an output kept alive keeps its
// span: so what a span retains is bounded by any one of its outputs). Values
// share a span only when their addresses agree modulo kPackAlign, so each
// output starts kPackAlign-aligned in its allocation.
constexpr size_t kPackBytes = size_t{1} << 20;
constexpr size_t kPackPieceBytes = size_t{16} << 20;
constexpr size_t kPackAlign = 64;  // >= every dtype's alignment; vector loads want 16 or more
constexpr size_t kSpanSlack = 4096;
constexpr size_t kSpanFloor = size_t{256} << 10;
constexpr size_t kSpanRatio = 16;
// Disk tier: files grow by chunks of at least kDiskMinChunk; I/O moves
// kDiskPiece at a time (fetch_file copies one piece while reading the next; a
// disk-tier fetch's copies follow all of its reads, ~15x faster than the disk).
constexpr size_t kDiskMinChunk = size_t{32} << 20;
constexpr size_t kDiskPiece = size_t{8} << 20;
// Disk I/O buffers kept for reuse: mapping and pre-faulting them per copy costs
// as much as the copy.
constexpr size_t kBouncePoolBytes = size_t{256} << 20;
// The disk tier's own pinned I/O buffers (outside the budget): 64 MiB chunks, 256 MiB at most.
constexpr size_t kBounceChunkBytes = size_t{64} << 20;
constexpr size_t kBounceArenaBytes = size_t{256} << 20;

// After a device OOM for a snapshot's staging buffer, stores of that size or
// more go without staging for this long.
constexpr std::chrono::milliseconds kStagingOomBackoff{1000};

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
inline bool dense_enough(size_t span, size_t payload) { return span <= 2 * payload + kSpanSlack; }
// Whether a span may hold a value of `smallest` bytes, its smallest, alive.
inline bool retains_little(size_t span, size_t smallest) {
  return span <= kSpanFloor || span <= kSpanRatio * smallest;
}

// True when the tensor's elements fill [data_ptr, data_ptr + nbytes) exactly
// once (any dimension order, e.g. channels_last): its bytes can be copied as
// one run and viewed again with the same strides.
inline bool dense(const at::Tensor& t) { return t.is_non_overlapping_and_dense(); }

// `t` with its conj/neg bits resolved and laid out densely: the tensor itself
// when it already is (no copy, and no dispatcher call: the common case of every
// store), else a new tensor on the current stream, outside autograd.
inline at::Tensor materialized(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg() && dense(t)) return t;
  at::Tensor r = t.detach().resolve_conj().resolve_neg();
  return dense(r) ? r : r.contiguous();
}

// The bytes of a dense tensor as a uint8 tensor on its device (no copy).
inline at::Tensor bytes_of(const at::Tensor& t) {
  return at::for_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())})
      .options(at::TensorOptions().dtype(at::kByte).device(t.device()))
      .target_device(t.device())
      .make_tensor();
}

// A tensor of `like`'s dtype, sizes and (dense) strides viewing `storage` at
// `byte_offset`.
inline at::Tensor view_of(const c10::Storage& storage, size_t byte_offset, const at::Tensor& like) {
  const c10::DispatchKey key =
      storage.device().is_cpu() ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    like.dtype());
  TORCH_INTERNAL_ASSERT(byte_offset % like.element_size() == 0, "offcache: misaligned view at ",
                        byte_offset, " for ", like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(
      like.sizes(), like.strides(), static_cast<int64_t>(byte_offset / like.element_size()));
  return t;
}

// `t` with `like`'s requires_grad flag (kept as a flag: no autograd graph is stored).
inline at::Tensor keep_flags(at::Tensor t, const at::Tensor& like) {
  if (like.requires_grad() && !t.requires_grad()) t.set_requires_grad(true);
  return t;
}

// An empty tensor laid out like the dense tensor `like` on `device`.
inline at::Tensor empty_like_on(const at::Tensor& like, c10::Device device) {
  return at::empty_strided(like.sizes(), like.strides(),
                           like.options().device(device).requires_grad(false));
}

// Packed spans alive and the bytes of their live outputs (stats(): packed_spans,
// packed_span_bytes, packed_output_bytes). Shared: outputs may outlive their engine.
struct SpanTally {
  std::atomic<size_t> spans{0}, span_bytes{0}, output_bytes{0};
};

// What the outputs of a packed span share: the span's allocation (a fetch's device or host
// memory for a packed segment), alive while any of them is.
struct SpanShare {
  SpanShare(at::Tensor s, std::shared_ptr<SpanTally> t) : span(std::move(s)), tally(std::move(t)) {
    ++tally->spans;
    tally->span_bytes += span.nbytes();
  }
  ~SpanShare() {
    --tally->spans;
    tally->span_bytes -= span.nbytes();
  }
  SpanShare(const SpanShare&) = delete;
  SpanShare& operator=(const SpanShare&) = delete;
  at::Tensor span;
  std::shared_ptr<SpanTally> tally;
};

// Each output's storage holds one SpanRef as its DataPtr context (`bytes`: the output's).
struct SpanRef {
  SpanRef(std::shared_ptr<SpanShare> s, size_t b) : share(std::move(s)), bytes(b) {
    share->tally->output_bytes += bytes;
  }
  ~SpanRef() { share->tally->output_bytes -= bytes; }
  SpanRef(const SpanRef&) = delete;
  SpanRef& operator=(const SpanRef&) = delete;
  std::shared_ptr<SpanShare> share;
  size_t bytes;
};
inline void release_span_ref(void* ref) { delete static_cast<SpanRef*>(ref); }

// The allocation `t`'s memory belongs to: the span of a packed output, else `t` itself.
inline at::Tensor allocation_of(const at::Tensor& t) {
  if (!t.has_storage()) return t;
  auto* ref = t.storage().data_ptr().cast_context<SpanRef>(&release_span_ref);
  return ref != nullptr ? ref->share->span : t;
}

// A packed value's output inside `span`: its own storage over `p`, laid out like the dense
// tensor `like`. The values of one span cost one allocation and one hand-over between them,
// not one each. The storage is resizable with the span's allocator: grown, it moves to memory
// of its own, as any tensor's would.
inline at::Tensor output_in(const std::shared_ptr<SpanShare>& share, void* p,
                            const at::Tensor& like) {
  const at::Tensor& span = share->span;
  return at::for_blob(p, like.sizes())
      .strides(like.strides())
      .context(new SpanRef(share, like.nbytes()), &release_span_ref)
      .options(like.options().device(span.device()).requires_grad(false))
      .target_device(span.device())
      .resizeable_storage()
      .allocator(span.storage().allocator())
      .make_tensor();
}

// The one set of rules for what can be stored, worded as offcache/activations/tree.py's
// check_tensor words them (which adds the batch and the value).
inline void check_storable(const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), "offcache: cannot cache an undefined tensor");
  TORCH_CHECK_TYPE(t.layout() == c10::kStrided, "offcache: cannot cache a tensor with layout ",
                   t.layout(), "; only strided (dense) tensors can be cached: densify it first");
  TORCH_CHECK_TYPE(!t.is_quantized(), "offcache: cannot cache a quantized tensor (dtype ",
                   t.scalar_type(), "); dequantize it first");
  TORCH_CHECK_TYPE(!t.is_nested(),
                   "offcache: cannot cache a nested tensor; unbind it into a list first");
  TORCH_CHECK_VALUE(!t.is_meta(), "offcache: cannot cache a meta tensor: it has no data");
  const auto* impl = t.unsafeGetTensorImpl();
  TORCH_CHECK_TYPE(!impl->key_set().has(c10::DispatchKey::Python) && impl->has_storage(),
                   "offcache: cannot cache a tensor without data of its own (a wrapper tensor "
                   "subclass?): cache its inner tensors");
  if (t.numel() > 0) {
    size_t extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d)
      extent += static_cast<size_t>(t.size(d) - 1) * t.stride(d);
    const size_t need = (static_cast<size_t>(t.storage_offset()) + extent) * t.element_size();
    const size_t have = t.storage().nbytes();
    TORCH_CHECK_VALUE(have >= need, "offcache: cannot cache a tensor whose storage holds ", have,
                      " bytes but the tensor needs ", need, ": was its storage freed or resized?");
  }
}

// The GPU whose copy stream moves data between `a` and `b` (the CPU if neither).
inline c10::Device stream_device(c10::Device preferred, c10::Device other) {
  return preferred.is_cpu() ? other : preferred;
}

}  // namespace offcache::detail
