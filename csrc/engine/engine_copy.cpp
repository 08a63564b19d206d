// Engine::copy_into: copies into tensors the caller owns (an offloaded KV
// layer in the arena, a device buffer reused step after step), moving only
// the rows asked for.
#include <algorithm>
#include <optional>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

namespace {

// A tensor's bytes as `rows` runs of `run` bytes, `pitch` bytes apart.
struct Rows {
  char* ptr;
  size_t rows, run, pitch;
};

std::optional<Rows> rows_of(const at::Tensor& t) {
  const size_t elt = t.element_size();
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), sizes > 1 only
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.size(d), t.stride(d));
  }
  auto* p = static_cast<char*>(t.data_ptr());
  if (dims.empty()) return Rows{p, 1, elt, elt};
  // The innermost contiguous run: merge dimensions while they are contiguous.
  auto [run, stride] = dims.back();
  dims.pop_back();
  if (stride != 1) return std::nullopt;
  while (!dims.empty() && dims.back().second == run) {
    run *= dims.back().first;
    dims.pop_back();
  }
  if (dims.empty()) return Rows{p, 1, run * elt, run * elt};
  // Everything outside it must be one evenly spaced dimension.
  auto [rows, pitch] = dims.back();
  dims.pop_back();
  while (!dims.empty() && dims.back().second == rows * pitch) {
    rows *= dims.back().first;
    dims.pop_back();
  }
  // Rows closer than a run (expanded or overlapping) are not a 2-D copy.
  if (!dims.empty() || pitch < run) return std::nullopt;
  return Rows{p, static_cast<size_t>(rows), run * elt, static_cast<size_t>(pitch) * elt};
}

// `r` (one run) cut into the rows of `like`.
Rows reshaped(Rows r, const Rows& like) {
  if (r.rows == 1 && like.rows > 1 && r.run == like.rows * like.run)
    return Rows{r.ptr, like.rows, like.run, like.run};
  return r;
}

}  // namespace

EventPtr Engine::copy_into(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                           bool wait) {
  check_streams();
  TORCH_CHECK_VALUE(dsts.size() == srcs.size(), "offcache: copy_into needs as many destinations (",
                    dsts.size(), ") as sources (", srcs.size(), ")");
  struct Group {
    Dir dir;
    c10::Device stream_device;
    std::vector<CopyOp> ops;
    std::vector<EventPtr> deps;
    std::vector<HostBlock*> read, written;
    c10::Device consumer;
    std::vector<c10::Device> ordered;    // GPUs whose current stream the group follows
    std::vector<at::Tensor> srcs, dsts;  // kept alive until the copies complete
  };
  std::vector<Group> groups;
  std::vector<c10::Device> resolved;
  auto resolve = [&](c10::Device d) {
    resolve_once(d, &resolved);
    return d;
  };
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& dst = dsts[i];
    const at::Tensor& src = srcs[i];
    TORCH_CHECK_VALUE(
        dst.defined() && src.defined() && dst.dtype() == src.dtype() && dst.sizes() == src.sizes(),
        "offcache: copy_into pair ", i, ": destination ", dst.dtype(), dst.sizes(), " and source ",
        src.dtype(), src.sizes(), " must have one dtype and shape");
    const c10::Device from = resolve(src.device());
    const c10::Device to = resolve(dst.device());
    backend_->enable_peer_access(from, to);
    HostBlock* src_block = host_block_of(src);
    HostBlock* dst_block = host_block_of(dst);
    // Between a GPU and the host, the host side must be offcache's (pinned, fenced).
    TORCH_CHECK_VALUE(from.is_cpu() == to.is_cpu() || (from.is_cpu() ? src_block : dst_block),
                      "offcache: copy_into pair ", i,
                      ": host memory must be offcache's (a view of a stored tensor)");
    TORCH_CHECK_VALUE(!dst.is_conj() && !dst.is_neg() && !src.is_conj() && !src.is_neg(),
                      "offcache: copy_into pair ", i, ": resolve conj/neg views first");
    if (src.numel() == 0) continue;
    auto s = rows_of(src), d = rows_of(dst);
    TORCH_CHECK_VALUE(s && d, "offcache: copy_into pair ", i,
                      ": each side must be rows of contiguous bytes at one pitch, got strides ",
                      src.strides(), " and ", dst.strides());
    *s = reshaped(*s, *d);
    *d = reshaped(*d, *s);
    TORCH_CHECK_VALUE(s->rows == d->rows && s->run == d->run, "offcache: copy_into pair ", i,
                      ": source and destination are laid out differently (strides ", src.strides(),
                      " and ", dst.strides(), ")");
    // Into offcache's host memory (or from a GPU to the host): D2H, on the
    // source GPU's stream; otherwise H2D, on the destination's.
    const bool into_host = to.is_cpu() && (!from.is_cpu() || dst_block != nullptr);
    if (from == to) {  // like Tensor.copy_: no partial overlap between source and destination
      auto end = [](const Rows& r) { return r.ptr + (r.rows - 1) * r.pitch + r.run; };
      TORCH_CHECK_VALUE(end(*s) <= d->ptr || end(*d) <= s->ptr, "offcache: copy_into pair ", i,
                        ": the source and the destination overlap in memory");
    }
    const Dir dir = into_host ? Dir::kStore : Dir::kFetch;
    const c10::Device sdev = into_host ? from : to;
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const Group& x) { return x.dir == dir && x.stream_device == sdev; });
    if (g == groups.end()) {
      groups.push_back(Group{dir, sdev, {}, {}, {}, {}, to, {}, {}, {}});
      g = groups.end() - 1;
    }
    // Each source's producer -> copy, and each destination's queued readers ->
    // copy: once per GPU of the group, whichever pair brings it.
    for (c10::Device dev : {from, to}) {
      if (dev.is_cpu() || std::find(g->ordered.begin(), g->ordered.end(), dev) != g->ordered.end())
        continue;
      g->ordered.push_back(dev);
      g->deps.push_back(backend_->record_current(dev));
    }
    g->ops.push_back(CopyOp{d->ptr, s->ptr, s->run, s->rows, d->pitch, s->pitch});
    g->srcs.push_back(src);
    g->dsts.push_back(dst);
    if (src_block) g->read.push_back(src_block);
    if (dst_block) g->written.push_back(dst_block);
  }
  EventPtr last;
  for (auto& g : groups) {
    {
      auto l = lock();
      // A copy still writing a device source or destination, and (for a
      // destination) D2H copies still reading it.
      for (const auto* side : {&g.srcs, &g.dsts}) {
        for (const auto& t : *side) {
          if (t.device().is_cpu()) continue;
          if (EventPtr e = pending_write_of(t)) g.deps.push_back(std::move(e));
          if (side == &g.dsts) pending_reads_of(t, &g.deps);
        }
      }
      // Read after write, and write after read or write, on host blocks.
      for (HostBlock* hb : g.read) {
        if (hb->stored && !is_complete(hb->stored, nullptr)) g.deps.push_back(hb->stored);
      }
      for (HostBlock* hb : g.written)
        g.deps.insert(g.deps.end(), hb->fences.begin(), hb->fences.end());
    }
    if (last) g.deps.push_back(last);
    std::vector<at::Tensor> keepalive(g.srcs);
    keepalive.insert(keepalive.end(), g.dsts.begin(), g.dsts.end());
    EventPtr done = issue(g.dir, backend_->copy_stream(g.dir, g.stream_device), g.deps, g.ops,
                          hold(std::move(keepalive)));
    auto l = lock();
    for (HostBlock* hb : g.read) hb->add_fence(done);
    for (HostBlock* hb : g.written) {
      hb->stored = done;
      hb->add_fence(done);
    }
    // Device memory has no fences: later copies find these in the maps.
    for (const auto& t : g.srcs) {
      if (!t.device().is_cpu() && t.has_storage()) note_device_access(t, done, /*write=*/false);
    }
    for (const auto& t : g.dsts) {
      if (!t.device().is_cpu() && t.has_storage()) note_device_access(t, done, /*write=*/true);
    }
    l.unlock();
    // The destinations changed: their version counters say so (dedup trusts
    // them; views share the counter). Inference tensors have none.
    for (const auto& t : g.dsts) {
      if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
    }
    last = done;
  }
  if (wait && last) {
    for (const auto& g : groups) {
      if (!g.consumer.is_cpu()) backend_->current_wait(g.consumer, last);
    }
    if (std::all_of(groups.begin(), groups.end(),
                    [](const Group& g) { return g.consumer.is_cpu(); })) {
      backend_->sync(last);
    }
  }
  return last;
}

}  // namespace offcache
