#include "host_block.h"

#include <ATen/Tensor.h>

#include <algorithm>

namespace offcache {
namespace {

void delete_host_block(void* ctx) {
  auto* block = static_cast<HostBlock*>(ctx);
  if (block->refs.fetch_sub(1) == 1) block->owner->release(block);
}

}  // namespace

void HostBlock::add_fence(const EventPtr& event) {
  if (std::find(fences.begin(), fences.end(), event) != fences.end()) return;
  // Completed fences are dropped once a few have gathered: a query each, not
  // every fence queried on every copy. Dropping is housekeeping: a query that
  // fails (refused for now during another thread's graph capture, or for good
  // on a broken context, which the engine's next reap raises) keeps every
  // fence, and `event` is added all the same: its copy was issued.
  if (fences.size() >= 4) {
    try {
      drop_completed(&fences, [this](const EventPtr& e) { return owner->fence_done(e); });
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): all kept, as above
    }
  }
  fences.push_back(event);
}

c10::Storage make_host_storage(HostBlock* block, size_t offset, size_t bytes) {
  TORCH_INTERNAL_ASSERT(offset + bytes <= block->block.size);
  ++block->refs;
  c10::DataPtr data(static_cast<char*>(block->block.ptr) + offset, block, &delete_host_block,
                    c10::Device(c10::kCPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

HostBlock* host_block_of(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !t.has_storage()) return nullptr;
  const c10::DataPtr& data = t.storage().data_ptr();
  if (data.get_deleter() != &delete_host_block) return nullptr;
  return static_cast<HostBlock*>(data.get_context());
}

}  // namespace offcache
