// Engine::fetch: copies from the arena (or anywhere) into independent tensors
// on the consumer's device. Values packed in one host block move as one span
// copy into one allocation, inside which each value's output is a storage of
// its own (detail::output_in): one allocation and one hand-over per span.
#include <algorithm>
#include <functional>
#include <map>
#include <utility>

#include "engine.h"
#include "engine_detail.h"
#include "region/shared_region.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

namespace {

struct Source {
  at::Tensor dense;            // what the copy reads: conj/neg resolved, dense
  HostBlock* block = nullptr;  // the arena block `dense` lies in, if any
  SharedSpan* span = nullptr;  // the shared mapping `dense` lies in, if any (shared_region.h)
};

// Items that move together: one span of one host block, or one value.
struct Segment {
  const char* begin;
  size_t length;
  size_t payload;
  size_t smallest;  // its smallest value's bytes: what the span may retain is bounded by it
  std::vector<size_t> items;
  HostBlock* block;
};

// Every output is a storage of its own, whatever the dedup did: values whose
// bytes overlap in a block (one stored copy fetched twice, views of one value)
// would share memory in a span. Of each overlap, all but the first by address
// go alone (marked here, before any span is formed, so they never count toward
// one's payload: a span stays within twice the bytes of the outputs in it).
std::vector<char> overlapping(std::vector<size_t> packable, const std::vector<Source>& sources) {
  std::vector<char> apart(sources.size(), 0);
  if (packable.size() < 2) return apart;
  const auto begin_of = [&](size_t i) {
    return static_cast<const char*>(sources[i].dense.data_ptr());
  };
  std::sort(packable.begin(), packable.end(), [&](size_t a, size_t b) {
    if (sources[a].block != sources[b].block) {
      return std::less<const HostBlock*>()(sources[a].block, sources[b].block);
    }
    return begin_of(a) < begin_of(b);
  });
  const HostBlock* block = nullptr;
  const char* end = nullptr;  // the furthest byte a kept value of `block` reaches
  for (size_t i : packable) {
    const char* p = begin_of(i);
    if (sources[i].block == block && p < end) {
      apart[i] = 1;
      continue;
    }
    block = sources[i].block;
    end = p + sources[i].dense.nbytes();
  }
  return apart;
}

}  // namespace

Engine::Fetched Engine::fetch(const std::vector<at::Tensor>& stored, c10::Device device,
                              bool wait) {
  check_streams();
  reap_shared();  // mappings that died while earlier copies read them, if those completed
  device = backend_->resolve_device(device, /*waits_only=*/true);  // the consumer
  const size_t n = stored.size();
  std::vector<at::Tensor> out(n);
  std::vector<c10::Device> resolved{device};
  for (const auto& t : stored) {
    TORCH_CHECK_TYPE(t.defined() && t.layout() == c10::kStrided,
                     "offcache: can only fetch dense tensors");
    resolve_once(t.device(), &resolved);
  }
  // Pending writes are looked up before anything reads the values (a view
  // being made dense reads them too).
  std::vector<EventPtr> pending(n);
  {
    auto l = lock();
    QueryMemo memo;
    for (size_t i = 0; i < n; ++i) pending[i] = pending_write_of(stored[i], &memo);
  }
  // The devices the values live on: each is a producer whose queued work the
  // copy (and any materialising kernel) must follow.
  std::vector<c10::Device> source_devices;
  std::vector<Source> sources(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = stored[i];
    if (t.device() == device && host_block_of(t) == nullptr && shared_span_of(t) == nullptr) {
      // Already where it is wanted and not arena (or shared) memory: no copy, like Tensor.to();
      // a peer store still filling it is waited for.
      if (pending[i]) backend_->current_wait(device, pending[i]);
      out[i] = t;
      continue;
    }
    // Made dense or resolved now (a host op, or a kernel on the source's
    // stream)? Then that read waits for the pending write; a dense value is
    // read by the copy, whose stream waits instead (no host block).
    if (pending[i] && (t.is_conj() || t.is_neg() || !dense(t))) {
      backend_->current_wait(t.device(), pending[i]);
      pending[i] = nullptr;
    }
    at::Tensor d = materialized(t.detach());
    if (d.numel() == 0) {
      out[i] = keep_flags(empty_like_on(d, device), t);
      continue;
    }
    HostBlock* hb = d.is_alias_of(t) ? host_block_of(t) : nullptr;
    // A shared mapping is copied from like arena memory, one value a segment (not packed).
    SharedSpan* span = d.is_alias_of(t) ? shared_span_of(t) : nullptr;
    sources[i] = Source{std::move(d), hb, span};
    if (std::find(source_devices.begin(), source_devices.end(), t.device()) ==
        source_devices.end()) {
      source_devices.push_back(t.device());
    }
  }

  std::vector<EventPtr> done_events;
  std::vector<HeldTensors> held;   // each group's, for the caller's ticket
  std::vector<at::Tensor> handed;  // device allocations handed over to the consumer's stream
  // Host memory last: its group may be issued by the I/O thread (disk blocks), so its
  // event, then the whole fetch's, is a ChainedEvent that no earlier group waits on.
  std::stable_partition(source_devices.begin(), source_devices.end(),
                        [](c10::Device d) { return !d.is_cpu(); });
  const bool pack = backend_->packs_outputs(device);  // else one allocation per output
  for (c10::Device from : source_devices) {
    // Segments: a host block's values move as one span while it stays dense enough and
    // retains little (engine_detail.h). Values share a span only when their addresses agree
    // modulo kPackAlign: the span starts at its lowest value, so every output starts
    // kPackAlign-aligned in the allocation (itself aligned at least that much). Values stored
    // together are, so they share one; views at other offsets (a slice) get spans of their own.
    const auto packable = [&](size_t i) {
      const Source& s = sources[i];
      return pack && s.dense.defined() && s.dense.device() == from && s.block != nullptr &&
             s.dense.nbytes() < kPackBytes;
    };
    std::vector<size_t> candidates;
    for (size_t i = 0; i < n; ++i) {
      if (packable(i)) candidates.push_back(i);
    }
    const std::vector<char> apart = overlapping(std::move(candidates), sources);
    std::vector<Segment> segments;
    std::map<std::pair<HostBlock*, uintptr_t>, size_t> open;  // (block, address % align) -> span
    for (size_t i = 0; i < n; ++i) {
      const Source& s = sources[i];
      if (!s.dense.defined() || s.dense.device() != from) continue;
      const auto* p = static_cast<const char*>(s.dense.data_ptr());
      const size_t bytes = s.dense.nbytes();
      if (packable(i) && !apart[i]) {
        const auto key = std::make_pair(s.block, reinterpret_cast<uintptr_t>(p) % kPackAlign);
        auto it = open.find(key);
        if (it != open.end()) {
          Segment& seg = segments[it->second];
          const char* lo = std::min(seg.begin, p);
          const size_t hi = std::max<size_t>(seg.begin + seg.length - lo, p + bytes - lo);
          const size_t smallest = std::min(seg.smallest, bytes);
          if (dense_enough(hi, seg.payload + bytes) && retains_little(hi, smallest)) {
            seg.begin = lo;
            seg.length = hi;
            seg.payload += bytes;
            seg.smallest = smallest;
            seg.items.push_back(i);
            continue;
          }
        }
        open[key] = segments.size();
      }
      segments.push_back(Segment{p, bytes, bytes, bytes, {i}, s.block});
    }

    // From host memory: the H2D stream of the consumer's device (a host worker
    // for the CPU); from a GPU: that GPU's D2H stream.
    const Dir dir = from.is_cpu() ? Dir::kFetch : Dir::kStore;
    const c10::Device stream_dev = from.is_cpu() ? device : from;
    CopyStream& stream = backend_->copy_stream(dir, stream_dev);
    std::vector<CopyOp> ops;
    // What the copies touch, until they complete; device memory allocated on the copy stream
    // itself (outputs and staging from host memory to a GPU) needs holding only until the
    // copies are queued there (the stream orders its reuse after them): not at all once
    // issue() returns, and until the I/O thread queued them for a disk group.
    const bool on_stream = from.is_cpu() && !device.is_cpu();
    std::vector<at::Tensor> keepalive, queued;
    std::vector<at::Tensor>& made = on_stream ? queued : keepalive;
    std::vector<at::Tensor> allocations;  // what holds the outputs' memory
    std::vector<EventPtr> deps;
    std::vector<HostBlock*> blocks;
    const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
    // Outputs and staging come from the copy stream's pool: the copy need not
    // wait for the consumer's queued work; outputs are handed to the consumer.
    // Near the allocator's memory limit that pool's allocation could free every
    // cached block, synchronising the device (the fetch would wait for the
    // queued compute): the outputs then come from the consumer's pool, and the
    // copy waits on the GPU, not the host, for the consumer's queued work.
    size_t out_bytes = 0;
    for (const Segment& seg : segments) out_bytes += seg.length;
    const bool own_pool = !on_stream || backend_->outputs_fit_copy_stream(device, out_bytes);
    const uint64_t retries_before = on_stream ? backend_->alloc_retries(device) : 0;
    const auto allocate = [&] {
      for (auto& seg : segments) {
        if (seg.items.size() == 1) {
          const size_t i = seg.items[0];
          at::Tensor o = empty_like_on(sources[i].dense, device);
          ops.push_back(
              CopyOp{o.data_ptr(), sources[i].dense.data_ptr(), sources[i].dense.nbytes()});
          out[i] = o;
          allocations.push_back(o);
        } else {
          // One allocation for the span: its values' outputs are storages inside it.
          at::Tensor span = at::empty({static_cast<int64_t>(seg.length)}, bytes);
          auto* base = static_cast<char*>(span.data_ptr());
          if (reinterpret_cast<uintptr_t>(base) % kPackAlign != 0) {
            // An allocator aligning less than kPackAlign (none of torch's): room to align.
            span = at::empty({static_cast<int64_t>(seg.length + kPackAlign)}, bytes);
            base = static_cast<char*>(span.data_ptr());
            base += align_up(reinterpret_cast<uintptr_t>(base), kPackAlign) -
                    reinterpret_cast<uintptr_t>(base);
          }
          ops.push_back(CopyOp{base, seg.begin, seg.length});
          auto share = std::make_shared<SpanShare>(span, span_tally_);
          for (size_t i : seg.items) {
            const auto* p = static_cast<const char*>(sources[i].dense.data_ptr());
            out[i] = output_in(share, base + (p - seg.begin), sources[i].dense);
          }
          allocations.push_back(span);
          made.push_back(std::move(span));
        }
        if (seg.block && std::find(blocks.begin(), blocks.end(), seg.block) == blocks.end()) {
          blocks.push_back(seg.block);
        }
      }
    };
    if (own_pool) {
      stream.enter(allocate);
    } else {
      allocate();  // the consumer's current stream's pool
      deps.push_back(backend_->record_current(device));
      for (const at::Tensor& a : allocations) stream.keep_for_copies(a);
    }
    const uint64_t retries =
        on_stream ? backend_->alloc_retries(device) - retries_before : 0;  // each synchronised
    // Disk blocks: their span is read into a bounce buffer on the I/O thread, which then
    // issues the whole batch itself (issue_after_reads): the caller never waits for the
    // disk (a CUDA stream cannot wait for a host thread without blocking the caller).
    std::vector<Block> bounces;
    if (disk_) {
      for (size_t k = 0; k < segments.size(); ++k) {
        const Segment& seg = segments[k];
        // Another engine's disk block (configure() since) is read through its mapping.
        if (seg.block == nullptr || !seg.block->disk() || seg.block->owner != this) continue;
        const size_t shift = (reinterpret_cast<uintptr_t>(seg.begin) -
                              reinterpret_cast<uintptr_t>(seg.block->block.ptr)) %
                             kDiskAlign;
        char* bounce = nullptr;
        bounces.push_back(allocate_bounce(align_up(shift + seg.length, kDiskAlign), &bounce));
        EventPtr written;
        {
          auto l = lock();
          written = seg.block->stored;
        }
        io_->wait_event(written);
        read_from_disk(seg.begin, seg.length, bounce);
        ops[k].src = bounce + shift;  // ops[k] is segments[k]'s
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (!sources[i].dense.defined() || sources[i].dense.device() != from) continue;
      if (pending[i]) deps.push_back(pending[i]);
      keepalive.push_back(sources[i].dense);
      made.push_back(out[i]);
    }
    if (!from.is_cpu()) deps.push_back(backend_->record_current(from));  // GPU producer -> copy
    if (!from.is_cpu() && !device.is_cpu() && from != device) {
      // Outputs came from the consumer's pool (the copy stream is the source
      // GPU's): its queued kernels may still use that memory.
      deps.push_back(backend_->record_current(device));
      backend_->enable_peer_access(from, device);
    }
    // Several source devices (rare): each group follows the earlier ones, so the
    // last group's event is the whole fetch's.
    deps.insert(deps.end(), done_events.begin(), done_events.end());
    size_t total = 0;
    for (const CopyOp& op : ops) total += op.total();
    // Bounded per direction, like stores (a disk group's bounce buffers are its own):
    // past the bound this may wait for an earlier fetch's disk reads.
    throttle(total, dir);
    // issue() queues the copies before it returns: till then this call holds that memory.
    std::vector<at::Tensor> until_issued;
    if (bounces.empty()) until_issued.swap(queued);
    held.push_back(hold(std::move(keepalive), std::move(queued)));
    EventPtr done = bounces.empty() ? issue(dir, stream, deps, ops, held.back())
                                    : issue_after_reads(dir, stream, deps, ops, held.back());
    // From pageable host memory (a spilled block, a CPU tensor offcache does not hold) to a GPU,
    // cudaMemcpyAsync returns only once the driver staged the source: the caller waited. (A disk
    // group's copies are issued by the I/O thread, which does that waiting.)
    if (dir == Dir::kFetch && !device.is_cpu() && bounces.empty()) {
      // Its own blocks the engine knows; a foreign source is asked at most once per storage.
      const bool pinned_source = backend_->chunks().pinned();
      for (const Segment& seg : segments) {
        const Source& first = sources[seg.items[0]];
        const bool pinned = seg.block != nullptr    ? pinned_source && seg.block->pinned()
                            : first.span != nullptr ? first.span->registered
                                                    : foreign_pinned(first.dense);
        if (!pinned) {
          ++backend_->counters.syncs;
          break;
        }
      }
    }
    {
      auto l = lock();
      ++stats_.fetches;
      stats_.output_allocations += allocations.size();
      stats_.output_alloc_retries += retries;
      if (!own_pool) ++stats_.consumer_pool_fetches;
      if (!device.is_cpu()) stats_.handovers += allocations.size();
      for (const Block& b : bounces) deferred_.push(b, {done});
      for (HostBlock* hb : blocks) hb->add_fence(done);
    }
    if (!device.is_cpu()) {
      for (const at::Tensor& a : allocations) backend_->hand_over(a, device);
      handed.insert(handed.end(), allocations.begin(), allocations.end());
    }
    // No snapshot is taken of a GPU source: later work on its stream must not
    // modify it before the copy has read it.
    if (!from.is_cpu()) backend_->current_wait(from, done);
    // Shared mappings: their copies are fences (unregistered and unmapped after them) and counted.
    size_t shared_bytes = 0;
    bool shared_pinned = true;
    for (size_t i = 0; i < n; ++i) {
      const Source& src = sources[i];
      if (src.span == nullptr || src.dense.device() != from || done == nullptr) continue;
      src.span->add_fence(done);
      shared_bytes += src.dense.nbytes();
      shared_pinned = shared_pinned && src.span->registered;
    }
    if (shared_bytes > 0) note_shared_fetch(shared_bytes, shared_pinned);
    done_events.push_back(done);
  }
  EventPtr last = done_events.empty() ? nullptr : done_events.back();
  for (size_t i = 0; i < n; ++i) {
    if (sources[i].dense.defined()) keep_flags(out[i], stored[i]);
  }
  std::vector<Tensors> taken;  // dies on return, after `out` took its references
  if (wait && last) {
    backend_->current_wait(device, last);
    // A CPU consumer's wait proves the copies complete (the engine need hold nothing more);
    // a GPU consumer's proves them queued.
    for (const HeldTensors& h : held)
      device.is_cpu() ? h->take_all(&taken) : h->take_queued(&taken);
  }
  std::shared_ptr<Handoff> handoff = handed.empty() ? nullptr : backend_->handoff(handed, device);
  return {std::move(out), last, std::move(held), std::move(handoff)};
}

}  // namespace offcache
