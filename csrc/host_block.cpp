#include "host_block.h"

#include <ATen/Tensor.h>

#include <algorithm>

#include "engine.h"

namespace offcache {
namespace {

void delete_host_block(void* ctx) {
  auto* block = static_cast<HostBlock*>(ctx);
  if (block->refs.fetch_sub(1) == 1) block->engine->release(block);
}

}  // namespace

void HostBlock::add_fence(const EventPtr& event) {
  if (std::find(fences.begin(), fences.end(), event) != fences.end()) return;
  // Completed fences are dropped once a few have gathered: a query each, not
  // every fence queried on every copy.
  if (fences.size() >= 4) {
    Backend& backend = const_cast<Backend&>(engine->backend());
    fences.erase(std::remove_if(fences.begin(), fences.end(),
                                [&backend](const EventPtr& e) { return backend.query(e); }),
                 fences.end());
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
