// The primitives that differ between the CUDA and host backends. Everything
// else (arena, dedup, snapshots, fences, deferred frees, batching, in-flight
// bounds) lives in the engine and is shared. The seam is the copy stream: a
// CUDA stream or a host worker thread; an event is a CUDA event or a flag.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/event.h"

namespace offcache {

enum class Dir { kStore = 0, kFetch = 1 };  // D2H, H2D
enum class BackendKind { kHost, kCuda };

// `rows` runs of `bytes` each, `dst_pitch` / `src_pitch` apart (one 2-D copy call).
struct CopyOp {
  void* dst;
  const void* src;
  size_t bytes;
  size_t rows = 1;
  size_t dst_pitch = 0;
  size_t src_pitch = 0;
  size_t total() const { return bytes * rows; }
};

// What the backend primitives were asked to do. Both backends count the same
// things at the same places, so tests on the host backend bound the CUDA path.
struct Counters {
  std::atomic<uint64_t> events_created{0};  // new driver events (a pooled one is not new)
  std::atomic<uint64_t> events_recorded{0};
  std::atomic<uint64_t> stream_waits{0};  // a stream (or the host) ordered after an event
  std::atomic<uint64_t> copy_calls{0};    // cudaMemcpyAsync calls, or memcpy calls
  std::atomic<uint64_t> host_callbacks{0};
  std::atomic<uint64_t> pinned_registrations{0};
  std::atomic<uint64_t> syncs{0};             // the host blocked on an event (or a blocking copy)
  std::atomic<uint64_t> event_queries{0};     // the engine asked whether an event completed
  std::atomic<uint64_t> threads_prepared{0};  // engine threads that ran prepare_thread()
  // Chunks the backend's chunk source made and took back (on CUDA each is a
  // cudaHostRegister / cudaHostUnregister; on the host an mmap / munmap).
  std::atomic<uint64_t> chunks_made{0};
  std::atomic<uint64_t> chunks_released{0};
  // Chunks whose cudaHostUnregister failed: kept mapped (and registered) for
  // good, since unmapping memory the driver may still use would be worse.
  std::atomic<uint64_t> chunks_kept_registered{0};
  // Driver calls asking whether a foreign CPU source of a fetch is pinned (cudaPointerGetAttributes
  // through Tensor::is_pinned): the engine's own memory and torch's allocators need none.
  std::atomic<uint64_t> pinned_queries{0};
};

// A backend's chunk source, counted (Counters::chunks_made / chunks_released).
class CountedChunks final : public ChunkSource {
 public:
  CountedChunks(ChunkSource& source, Counters& counters) : source_(source), counters_(counters) {}
  void* allocate(size_t bytes, std::string* error) override {
    void* p = source_.allocate(bytes, error);
    if (p != nullptr) ++counters_.chunks_made;
    return p;
  }
  void release(void* ptr, size_t bytes) noexcept override {
    ++counters_.chunks_released;
    source_.release(ptr, bytes);
  }
  bool pinned() const override { return source_.pinned(); }

 private:
  ChunkSource& source_;
  Counters& counters_;
};

// A fetch's device outputs as its ticket sees them, weakly (a ticket must not
// keep them alive): a stream that waits on the ticket other than the one they
// were handed to at the fetch is recorded on them too, so the allocator does
// not reuse them before that stream's work is done.
class Handoff {
 public:
  virtual ~Handoff() = default;
  virtual void to_current(int device) = 0;
};

// A copy stream: work submitted to it runs in order.
class CopyStream {
 public:
  virtual ~CopyStream() = default;
  // Later work on this stream starts after `event` completes.
  virtual void wait(const EventPtr& event) = 0;
  virtual void copy(const std::vector<CopyOp>& ops) = 0;
  // timed: the event can measure elapsed time (only while tracing or timing).
  virtual EventPtr record(bool timed) = 0;
  // After `deps`, `ops`, issued by an engine I/O thread once the
  // reads they copy from are done; returns their completion. A CUDA stream
  // queues them. A host stream runs them on the calling thread (null: done):
  // queued, they could sit behind a host stream's blocking wait for an event
  // that itself follows them, and deadlock.
  virtual EventPtr copy_after(const std::vector<EventPtr>& deps,
                              const std::vector<CopyOp>& ops) = 0;
  // Runs `fn` now with this stream as the current one: device memory that fn
  // allocates comes from this stream's pool (on the host: just runs fn).
  virtual void enter(const std::function<void()>& fn) = 0;
  // Device memory `t` allocated on another stream (the consumer's) is written by copies queued
  // here next: the allocator does not reuse it before they complete (on the host: nothing).
  virtual void keep_for_copies(const at::Tensor& /*t*/) {}
  // Best effort, never throws: used while unwinding after a failed enqueue.
  virtual void synchronize_noexcept() noexcept = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  std::string name() const { return kind() == BackendKind::kCuda ? "cuda" : "host"; }
  // Source of the arena's chunks: pinned on CUDA, plain memory on host.
  virtual ChunkSource& chunks() = 0;
  virtual const ChunkSource& chunks() const = 0;
  // `device` with its index filled in ("cuda" -> the current CUDA device);
  // raises a clear error if this backend cannot serve it. waits_only: the call only orders the
  // device's current stream after a copy (a fetch's consumer), queuing nothing else on it.
  virtual c10::Device resolve_device(c10::Device device, bool waits_only = false) const = 0;
  // The GPU whose context the engine's own CUDA calls on callers' threads select (pinned
  // registrations): the first one the engine used, else the calling thread's current one, now
  // claimed; -1 without one (the host backend). Never throws.
  virtual int claim_device() const { return -1; }

  // Event on the calling thread's current stream of `device`: the producer
  // of a store, the consumer of a fetch. Already complete for the CPU.
  virtual EventPtr record_current(c10::Device device) = 0;
  // The current stream of `device` (the calling thread for the CPU) waits for `event`.
  virtual void current_wait(c10::Device device, const EventPtr& event) = 0;
  // The copy stream for direction `dir` whose engine moves data to or from
  // `device` (the CPU: a host worker thread).
  virtual CopyStream& copy_stream(Dir dir, c10::Device device) = 0;
  // A timed event on the current stream of `device`: the zero of a copy trace.
  virtual EventPtr trace_origin(c10::Device device) = 0;
  // A device tensor allocated on a copy stream is handed to the consumer's
  // current stream: the allocator must not reuse it before the consumer is done.
  virtual void hand_over(const at::Tensor& t, c10::Device consumer) = 0;
  // What a ticket needs to hand `outs` (handed over to `consumer` at the fetch)
  // to the stream that waits on it (null: nothing to do, as on the host).
  virtual std::shared_ptr<Handoff> handoff(const std::vector<at::Tensor>& /*outs*/,
                                           c10::Device /*consumer*/) {
    return nullptr;
  }
  // Whether small outputs for `consumer` may share one allocation (a span copy,
  // each output a storage inside it): only where the allocator ignores memory it
  // did not allocate, so that Tensor.record_stream on such an output stays legal
  // (a no-op there: offcache.record_stream records the span).
  virtual bool packs_outputs(c10::Device /*consumer*/) const { return true; }
  // Whether `bytes` of a fetch's outputs for `consumer` may come from its H2D copy stream's pool
  // without the allocator's free-and-retry: past its memory limit (a per-process fraction) that
  // frees every cached block, synchronising the device, so the fetch would wait for the queued
  // compute. False where they might: the outputs then come from the consumer's own pool (its
  // cached blocks, freed by its compute), and the copy waits on the GPU for its queued work.
  virtual bool outputs_fit_copy_stream(c10::Device /*consumer*/, size_t /*bytes*/) const {
    return true;
  }
  // The allocator's free-and-retry count of `device` (memory_stats' num_alloc_retries; 0: none).
  virtual uint64_t alloc_retries(c10::Device /*device*/) const { return 0; }
  // Whether a store of CPU memory is copied by the calling thread straight into
  // its host block: for a CPU producer the snapshot already is a copy by that
  // thread, so staging it and copying again on a copy stream only adds work. The
  // host backend slowed for tests (a copy delay) sends it through its D2H stream
  // instead, as a device's store goes, so that path runs on the CPU too.
  virtual bool copies_host_stores_inline() const { return true; }
  // Lets `from`'s copy engine read and write `to`'s memory directly.
  virtual void enable_peer_access(c10::Device from, c10::Device to) = 0;
  // Run by every engine-owned thread (the host copy streams' workers, the I/O
  // threads, the thread deleting a retired engine) before each task: a thread
  // of the engine's, never one of the caller's. Cheap once done (a thread-local
  // check). On CUDA it selects the backend's device before the thread's first
  // CUDA call (else the runtime makes a context on GPU 0 of every rank) and
  // relaxes the thread's capture mode (it never captures a graph, so its calls
  // must not invalidate a capture on another thread). Counted once per thread.
  virtual void prepare_thread() = 0;
  // Held by every engine call made through EngineUse, on the caller's thread, for the call's
  // length (null: nothing to hold). On CUDA it relaxes the thread's capture mode: a thread that
  // captures a graph on one stream may call the engine for work on other streams (the engine
  // refuses a capturing stream itself), and the engine's own calls on that thread (a staging
  // buffer's cudaMalloc, a chunk's cudaHostRegister, an event query or wait) must neither fail
  // nor invalidate the capture. The mode is restored when the call returns.
  struct CallScope {
    virtual ~CallScope() = default;
  };
  virtual std::unique_ptr<CallScope> enter_call() const { return nullptr; }
  // The allocator of the pinned host memory torch makes for this backend (pin_memory()), if
  // any: its storages are pinned without asking the driver.
  virtual const c10::Allocator* pinned_host_allocator() const { return nullptr; }
  // Whether CPU tensor `t`'s memory is pinned for this backend, asked of torch (a driver call on
  // CUDA): a final answer, never the False torch gives for every pointer before its lazy init.
  virtual bool is_pinned(const at::Tensor& t) const { return t.is_pinned(); }
  // False in a forked child of a process whose engine cannot cross fork (CUDA).
  virtual bool in_owner_process() const { return true; }
  // Raises the fork error where in_owner_process() is false.
  virtual void check_process() const {}
  // The first error a host copy-stream task threw ("" if none).
  virtual std::string stream_error() = 0;
  // Whether `event` completed, counted (cudaEventQuery on CUDA). Throws
  // EventUnknown while it cannot be known, another error where it never will.
  bool query(const EventPtr& event) {
    ++counters.event_queries;
    return probe(event);
  }
  // query(), uncounted (deferred frees' fences), through the tests' fault hook.
  static bool probe(const EventPtr& event) {
    if (query_faults_armed.load(std::memory_order_relaxed)) maybe_fail_query();
    return event->query();
  }
  // Tests: the query after the next `skip` ones (counted or not) throws, once:
  // EventUnknown if `transient`, else an error as from a broken CUDA context.
  // skip < 0 disarms. Returns whether a fault armed before had not fired yet.
  static bool fail_query_after(int skip, bool transient);
  // current_wait() for a ChainedEvent (copies an I/O thread issues): the host
  // waits until they are issued (on the CPU: done), counted, and raises if they
  // were not all issued. False for any other event.
  bool wait_chained(c10::Device device, const EventPtr& event) {
    auto* chained = dynamic_cast<ChainedEvent*>(event.get());
    if (chained == nullptr) return false;
    if (device.is_cpu() ? !chained->query() : !chained->issued()) ++counters.syncs;
    chained->wait_current(device.is_cpu() ? -1 : device.index());
    return true;
  }
  // Host waits for `event`, counted.
  void sync(const EventPtr& event) {
    ++counters.syncs;  // the one place a host wait is counted
    event->wait();
  }

  static std::atomic<bool> query_faults_armed;
  static void maybe_fail_query();

  // Shared with CUDA events, which may outlive the backend (a ticket held by the
  // caller after configure() retired this engine).
  std::shared_ptr<Counters> shared_counters = std::make_shared<Counters>();
  Counters& counters = *shared_counters;
};

// True when the CUDA backend was compiled in (chosen in backend_select.cpp).
bool cuda_compiled();

}  // namespace offcache
