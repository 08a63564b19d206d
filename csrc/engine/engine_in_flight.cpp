// The engine's side of the in-flight ledger (core/in_flight.h) and of the
// deferred frees: issuing a batch and listing it, reaping completed batches,
// the per-direction bound, synchronize, and a dying block's release.
//
// Nothing is destroyed while mu_ is held: every reap goes through a Retire
// scope (mu_ plus what is retired under it), which releases mu_ before the
// retired tensors die, on every path, a query that throws included (an arena
// tensor dying calls release(), which takes mu_ again).
//
// Nor does anything under mu_ wait for the GIL (no Python-owned tensor's
// reference count changes under it: engine.h, docs/design.md). release() runs
// on the thread that dropped a block's last reference, often holding the GIL,
// and waits for mu_: that is safe only because mu_'s holders never wait for it.
#include <algorithm>
#include <cstdio>

#include "engine.h"
#include "engine_detail.h"
#include "region/shared_region.h"

namespace offcache {

void Engine::reclaim_locked() {
  try {
    deferred_.reclaim([](const EventPtr& e) { return Backend::probe(e); },
                      [this](const Block& b) { free_block(b); });
  } catch (const EventUnknown&) {
    // A fence cannot be queried now (a graph capture on another thread): the
    // blocks stay pending (reclaim is exception-safe) for a later call.
  }
}

void Engine::release(HostBlock* hb) noexcept {
  std::unique_ptr<HostBlock> owned(hb);
  // In a forked child the CUDA engine's events, registrations and mappings are
  // the parent's: touching them is undefined, so the block is left alone.
  if (!backend_->in_owner_process()) return;
  bool delete_now = false;
  {
    std::lock_guard<EngineMutex> guard(mu_);
    if (hb->staging) staging_bytes_ -= hb->block.size;
    try {
      deferred_.push(hb->block, std::move(hb->fences));
      reclaim_locked();  // a fence not known for now leaves the blocks pending
    } catch (const std::exception& e) {
      // A fence will never be known (a sticky CUDA error): whether a copy still
      // touches the pending blocks is unknown, so they are kept forever.
      stats_.leaked_blocks += deferred_.size();
      deferred_.forget();
      if (!broken_) {
        broken_ = true;
        std::fprintf(stderr,
                     "offcache: the CUDA context is broken (%s); freed host blocks are leaked "
                     "from now on instead of being reused\n",
                     e.what());
      }
    }
    delete_now = lifetime_.release_block();
  }
  if (delete_now) {
    try {
      delete_retired(this);
    } catch (...) {  // no thread to be had: the engine stays (a leak, not a crash)
    }
  }
}

void Engine::reap_locked(Retire& r) {
  // A stream's copies complete in order: each stream is queried up to its
  // first copy still running, not every entry on every call.
  try {
    in_flight_.reap(
        [this](const EventPtr& e) { return backend_->query(e); },
        [this](const InFlightLedger<Tensors>::Batch& b) {
          const double seconds = b.start ? b.done->elapsed_ms_since(*b.start) / 1000.0 : 0.0;
          (b.dir == static_cast<int>(Dir::kStore) ? stats_.d2h_seconds : stats_.h2d_seconds) +=
              seconds;
          if (trace_origin_ && b.start) {
            trace_.push_back(TraceRow{static_cast<Dir>(b.dir), b.bytes,
                                      b.start->elapsed_ms_since(*trace_origin_),
                                      b.done->elapsed_ms_since(*trace_origin_)});
          }
        },
        r.sink());
  } catch (const EventUnknown&) {
    // Not known for now (a graph capture on another thread): the batches from
    // that one on stay listed, asked again by a later call.
  }
  reclaim_locked();
}

void Engine::throttle(size_t incoming, Dir dir) {
  // Bounds bytes in flight in one direction (and so staging memory): waits for
  // that direction's oldest copy while the new one would not fit; a transfer
  // larger than the bound goes alone. Stores never wait for fetches, nor
  // fetches for stores: the two directions overlap.
  const int d = static_cast<int>(dir);
  for (;;) {
    EventPtr oldest;
    {
      Retire r = retiring();
      reap_locked(r);
      const size_t now = in_flight_.bounded_bytes(d);
      if (now == 0 || now + incoming <= max_in_flight_) return;
      oldest = in_flight_.oldest(d);
    }
    backend_->sync(oldest);
  }
}

EventPtr Engine::issue(Dir dir, CopyStream& stream, const std::vector<EventPtr>& deps,
                       const std::vector<CopyOp>& ops, HeldTensors held) {
  size_t bytes = 0;
  for (const auto& op : ops) bytes += op.total();
  bool timed;
  {
    auto l = lock();
    timed = timing_ || trace_origin_ != nullptr;
  }
  EventPtr start, done;
  try {
    std::vector<const Event*> seen;
    for (const auto& dep : deps) {
      if (!dep || std::find(seen.begin(), seen.end(), dep.get()) != seen.end()) continue;
      seen.push_back(dep.get());
      stream.wait(dep);
    }
    if (timed) start = stream.record(true);
    stream.copy(ops);
    done = stream.record(timed);
  } catch (...) {
    // Copies may already be queued that read or write `held` and the
    // callers' blocks: let them finish before anything is freed.
    stream.synchronize_noexcept();
    throw;
  }
  Retire r = retiring();
  track_locked(r, start, done, dir, bytes, ops.size(), std::move(held), &stream, true);
  return done;
}

void Engine::track_locked(Retire& r, EventPtr start, EventPtr done, Dir dir, size_t bytes,
                          size_t copies, HeldTensors held, const void* stream, bool bounded) {
  // Listed first: a reap that throws below must not drop what these copies touch.
  InFlightLedger<Tensors>::Batch b;
  b.start = std::move(start);
  b.done = std::move(done);
  b.bytes = bytes;
  b.dir = static_cast<int>(dir);
  b.stream = stream;
  b.bounded = bounded;
  b.held = std::move(held);
  in_flight_.add(std::move(b));
  if (dir == Dir::kStore) {
    stats_.d2h_bytes += bytes;
    stats_.d2h_copies += copies;
  } else {
    stats_.h2d_bytes += bytes;
    stats_.h2d_copies += copies;
  }
  note_peaks_locked();
  // Every call reaps: a fetch-only loop (calibration, KV decode) must not keep
  // finished copies' buffers and events alive.
  reap_locked(r);
}

void Engine::synchronize(bool check) {
  backend_->check_process();
  std::vector<EventPtr> events;
  {
    auto l = lock();
    events = in_flight_.events();
  }
  for (auto& e : events) {
    // A query refused for now (another thread's graph capture) is waited for, as the
    // reaps below leave what they cannot ask about for a later call.
    if (!is_complete(e, nullptr)) backend_->sync(e);
  }
  {
    Retire r = retiring();
    reap_locked(r);
    deferred_.wait_all();
    reclaim_locked();
  }
  // Shared mappings that died while this engine's copies (now complete) read them: unmapped
  // now, not at the next region call (unlocked: an unregistration is a driver call).
  reap_shared();
  if (check) check_streams();
}

}  // namespace offcache
