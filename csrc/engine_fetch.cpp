// Engine::fetch: H2D from the arena into device buffers, batched by host block.
#include <algorithm>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

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

}  // namespace offcache
