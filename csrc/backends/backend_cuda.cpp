// CUDA backend: a D2H and an H2D copy stream per device, pooled CUDA events,
// cudaMemcpyAsync, and pinned chunks made by cudaHostRegister on pre-touched
// pages. CPU-only traffic goes to host copy streams.
#include <ATen/ATen.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <utility>

#include "backend_host.h"
#include "cuda_check.h"
#include "cuda_pinned.h"

namespace offcache {
namespace {

// Whether work queued on `stream` would join a graph capture.
enum class Capture {
  kNone,
  kActive,     // `stream` itself is capturing
  kElsewhere,  // the legacy default stream while a blocking stream of its device captures
};

// cudaStreamIsCapturing, checked. On the legacy default stream while a blocking stream of the
// same device captures it answers cudaErrorStreamCaptureImplicit (not sticky): the legacy stream
// does not capture, but any work queued on it would join that capture, and is refused (and
// invalidates it).
Capture capture_of(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();
    return Capture::kElsewhere;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "offcache: CUDA call cudaStreamIsCapturing failed: ", cudaGetErrorName(err),
                ": ", cudaGetErrorString(err));
  }
  return status == cudaStreamCaptureStatusNone ? Capture::kNone : Capture::kActive;
}

// Untimed events are reused: creating one is a driver call, and every store
// and fetch records a few. Timed events (tracing, timing) are made fresh.
class EventPool {
 public:
  EventPool(int device, std::shared_ptr<Counters> counters)
      : device_(device), counters_(std::move(counters)) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);  // at exit the context may be gone
  }
  cudaEvent_t take(bool timed) {
    if (!timed) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaEvent_t e = nullptr;
    OFFCACHE_CUDA_CHECK(
        cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming));
    ++counters_->events_created;
    return e;
  }
  void give_back(cudaEvent_t e, bool timed) noexcept {
    if (!timed) {
      try {
        std::lock_guard<std::mutex> lock(mu_);
        free_.push_back(e);
        return;
      } catch (...) {  // no memory to keep it: destroy it instead
      }
    }
    if (cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
  }
  int device() const { return device_; }
  Counters* counters() const { return counters_.get(); }

 private:
  int device_;
  std::shared_ptr<Counters> counters_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

class CudaEvent final : public Event {
 public:
  // The pool is shared: an event (held by a ticket, say) may outlive its engine.
  CudaEvent(std::shared_ptr<EventPool> pool, bool timed)
      : pool_(std::move(pool)),
        counters_(pool_->counters()),
        timed_(timed),
        event_(pool_->take(timed)) {}
  ~CudaEvent() override { pool_->give_back(event_, timed_); }
  void record(cudaStream_t stream) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(pool_->device()));
    OFFCACHE_CUDA_CHECK(cudaEventRecord(event_, stream));
    ++counters_->events_recorded;
  }
  bool query() override {
    // On the event's device: a caller's thread whose current device is another (a deleter, a
    // Python thread on GPU 0 of a rank on cuda:1) would otherwise make a context there.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(pool_->device()));
    // Relaxed: a query from a thread that captures a graph (or while another thread captures
    // in global mode) would otherwise invalidate that capture.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (err == cudaErrorStreamCaptureUnsupported) {
      // A capture forbids the query all the same: not sticky, the context is not broken;
      // the ledger asks again later instead of taking it for broken and leaking what it holds.
      (void)cudaGetLastError();
      throw EventUnknown(std::string("offcache: CUDA call cudaEventQuery refused during a graph "
                                     "capture: ") +
                         cudaGetErrorName(err));
    }
    OFFCACHE_CUDA_CHECK(err);
    return true;
  }
  void wait() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(pool_->device()));  // as query()
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    OFFCACHE_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  void wait_current(int device) override {
    if (device < 0) return wait();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    const Capture capture = capture_of(stream);
    if (capture == Capture::kElsewhere) {
      // The legacy default stream while another thread captures on a blocking stream: a wait
      // queued on it would join that capture (refused, and the capture invalidated). The host
      // waits instead (a relaxed query and synchronize of a copy-stream event are allowed):
      // the stream's later work then finds the copy complete.
      bool done = false;
      try {
        done = query();
      } catch (const EventUnknown&) {  // NOLINT(bugprone-empty-catch): waited for below
      }
      if (!done) {
        ++counters_->syncs;
        wait();
      }
      return;
    }
    if (capture == Capture::kActive) {
      // A captured graph cannot wait on an event recorded outside its capture (the wait
      // would invalidate it). A copy already complete needs no wait: the graph's kernels
      // read finished outputs. One still in flight is refused, saying what to do instead.
      // Relaxed mode (query()) lets this thread query during its own capture; an event recorded
      // inside a capture cannot reach here (a fetch onto a capturing stream is refused).
      const bool done = query();
      TORCH_CHECK(done, "offcache: Ticket.wait() during a CUDA graph capture on cuda:", device,
                  ": the copy it waits for is still in flight, and a captured graph cannot wait "
                  "on an event recorded outside the capture. Wait before the capture begins "
                  "(fetch(..., wait=True), or ticket.wait() then a synchronize, before "
                  "torch.cuda.graph(...)), or poll ticket.query() until it is True.");
      return;
    }
    ++counters_->stream_waits;
    OFFCACHE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }
  double elapsed_ms_since(Event& start) override {
    auto* s = dynamic_cast<CudaEvent*>(&start);
    if (s == nullptr || !timed_ || !s->timed_) return 0.0;
    float ms = 0;
    const cudaError_t err = cudaEventElapsedTime(&ms, s->event_, event_);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return 0.0;
    }
    return ms;
  }
  cudaEvent_t get() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  Counters* counters_;
  bool timed_;
  cudaEvent_t event_;
};

CudaEvent* as_cuda(const EventPtr& e) { return dynamic_cast<CudaEvent*>(e.get()); }

// Handoff (backend.h): the stream the outputs were handed to at the fetch, and
// the outputs, weakly.
class CudaHandoff final : public Handoff {
 public:
  CudaHandoff(c10::cuda::CUDAStream handed,
              std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages)
      : handed_(handed), storages_(std::move(storages)) {}
  void to_current(int device) override {
    const c10::cuda::CUDAStream now =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    if (now == handed_) return;  // recorded at the fetch already
    // A wait in a capture queued nothing (the copies had completed: CudaEvent::wait_current), so
    // there is no later use on `now` to keep the outputs for; recording the capture stream would
    // only put memory from outside the capture into the allocator's capture bookkeeping. The
    // legacy stream beside a capture elsewhere (the host waited) does use them later: recorded.
    if (capture_of(now.stream()) == Capture::kActive) return;
    for (const auto& weak : storages_) {
      if (c10::intrusive_ptr<c10::StorageImpl> s = weak.lock())
        c10::cuda::CUDACachingAllocator::recordStream(s->data_ptr(), now);
    }
  }

 private:
  c10::cuda::CUDAStream handed_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages_;
};

// Copy streams outlive their engine. A fetch allocates its outputs on a copy stream, and an
// output may be freed after configure() retired (and deleted) that engine: the allocator frees on
// the stream that allocated (cudaMallocAsync: cudaFreeAsync on it, which a destroyed stream makes
// an error; the native allocator keys its cached blocks by it). So a copy stream is never
// destroyed, as torch's own pool streams are not: a deleted engine's go back here, idle (it was
// synchronised), and the next engine's are taken from here first. They never outnumber the copy
// streams of the engines alive at once.
class StreamRack {
 public:
  // A high-priority non-blocking stream on `device` (the current one), reused if one is free.
  cudaStream_t take(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (device < static_cast<c10::DeviceIndex>(free_.size()) && !free_[device].empty()) {
        cudaStream_t s = free_[device].back();
        free_[device].pop_back();
        return s;
      }
    }
    int least = 0, greatest = 0;
    OFFCACHE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    OFFCACHE_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    return s;
  }
  void give_back(c10::DeviceIndex device, cudaStream_t s) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      if (device >= static_cast<c10::DeviceIndex>(free_.size())) free_.resize(device + 1);
      free_[device].push_back(s);
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory to list it: it stays, unlisted
    }
  }
  static StreamRack& get() {
    static auto* rack = new StreamRack();  // never destroyed: nor are its streams
    return *rack;
  }

 private:
  std::mutex mu_;
  std::vector<std::vector<cudaStream_t>> free_;  // per device
};

class CudaCopyStream final : public CopyStream {
 public:
  CudaCopyStream(c10::DeviceIndex device, std::shared_ptr<EventPool> pool, Counters& counters)
      : device_(device), pool_(std::move(pool)), counters_(counters) {
    c10::cuda::CUDAGuard guard(device_);
    stream_ = StreamRack::get().take(device_);
  }
  void wait(const EventPtr& event) override {
    if (event == nullptr) return;
    if (auto* chained = dynamic_cast<ChainedEvent*>(event.get())) {
      // Copies an engine I/O thread issues: the host waits only until they are
      // queued (counted), then this stream waits on the last of them.
      if (!chained->issued()) ++counters_.syncs;
      return wait(chained->after_issued());
    }
    CudaEvent* e = as_cuda(event);
    if (e == nullptr) {  // produced on a host thread
      if (!event->query()) {
        ++counters_.syncs;
        event->wait();
      }
      return;
    }
    c10::cuda::CUDAGuard guard(device_);
    ++counters_.stream_waits;
    OFFCACHE_CUDA_CHECK(cudaStreamWaitEvent(stream_, e->get(), 0));
  }
  void copy(const std::vector<CopyOp>& ops) override {
    c10::cuda::CUDAGuard guard(device_);
    for (const auto& op : ops) {
      ++counters_.copy_calls;
      if (op.rows > 1) {
        OFFCACHE_CUDA_CHECK(cudaMemcpy2DAsync(op.dst, op.dst_pitch, op.src, op.src_pitch, op.bytes,
                                              op.rows, cudaMemcpyDefault, stream_));
      } else {
        OFFCACHE_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDefault, stream_));
      }
    }
  }
  EventPtr record(bool timed) override {
    auto event = std::make_shared<CudaEvent>(pool_, timed);
    event->record(stream_);
    return event;
  }
  EventPtr copy_after(const std::vector<EventPtr>& deps, const std::vector<CopyOp>& ops) override {
    for (const auto& dep : deps) wait(dep);  // GPU events: queued; host events: done by now
    copy(ops);
    return record(false);
  }
  void enter(const std::function<void()>& fn) override {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream_, device_));
    fn();
  }
  void keep_for_copies(const at::Tensor& t) override {
    if (!t.is_cuda() || !t.has_storage()) return;
    c10::cuda::CUDACachingAllocator::recordStream(
        t.storage().data_ptr(), c10::cuda::getStreamFromExternal(stream_, device_));
  }
  void synchronize_noexcept() noexcept override {
    if (cudaStreamSynchronize(stream_) != cudaSuccess) (void)cudaGetLastError();
  }
  // Only a retired engine, synchronised, is deleted: its stream is idle, and kept (StreamRack).
  ~CudaCopyStream() override { StreamRack::get().give_back(device_, stream_); }
  cudaStream_t get() const { return stream_; }

 private:
  c10::DeviceIndex device_;
  std::shared_ptr<EventPool> pool_;
  Counters& counters_;
  cudaStream_t stream_ = nullptr;
};

// Backend::enter_call() on CUDA: the calling thread's capture mode relaxed for one engine call.
struct RelaxedCall final : Backend::CallScope {
  c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int64_t host_copy_delay_us)
      : host_d2h_(counters, host_copy_delay_us, [this] { prepare_thread(); }),
        host_h2d_(counters, host_copy_delay_us, [this] { prepare_thread(); }),
        pinned_(counters, [this] { return claim_device(); }),
        owner_pid_(getpid()),
        generation_(fork_generation()) {
    const int n = c10::cuda::device_count();
    for (int d = 0; d < n; ++d) pools_.push_back(std::make_shared<EventPool>(d, shared_counters));
    streams_.resize(n);
    // What pin_memory() allocates with (torch's caching host allocator).
    pinned_allocator_ = at::globalContext().getPinnedMemoryAllocator(c10::DeviceType::CUDA);
  }
  BackendKind kind() const override { return BackendKind::kCuda; }
  ChunkSource& chunks() override { return counted_; }
  const ChunkSource& chunks() const override { return counted_; }

  std::unique_ptr<CallScope> enter_call() const override {
    // A forked child makes no CUDA call; nor does a thread whose current GPU has no context yet
    // (it captures nothing there, and asking would make one).
    if (!in_owner_process() || !c10::cuda::hasPrimaryContext(c10::cuda::current_device()))
      return nullptr;
    return std::make_unique<RelaxedCall>();
  }

  const c10::Allocator* pinned_host_allocator() const override { return pinned_allocator_; }
  bool is_pinned(const at::Tensor& t) const override {
    // Before torch's CUDA lazy init Tensor.is_pinned() is False for every pointer (at::Context::
    // isPinnedPtr), memory another library pinned included: initialised first (once per process).
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    return t.is_pinned();
  }
  bool in_owner_process() const override { return fork_generation() == generation_; }
  void check_process() const override {
    // The pid as a string: the message then needs no integer formatting (std::ostream).
    TORCH_CHECK(in_owner_process(), "offcache: the CUDA engine was created in process ",
                std::to_string(owner_pid_),
                " and cannot be used in a forked child; use the 'spawn' start method, or "
                "OFFCACHE_BACKEND=host in the child");
  }

  c10::Device resolve_device(c10::Device device, bool waits_only = false) const override {
    check_process();
    TORCH_CHECK(device.is_cpu() || device.is_cuda(), "offcache: unsupported device ", device);
    if (device.is_cuda() && !device.has_index()) {
      device = c10::Device(c10::kCUDA, c10::cuda::current_device());
    }
    TORCH_CHECK(device.is_cpu() || device.index() < static_cast<int>(streams_.size()),
                "offcache: no such CUDA device ", device);
    if (device.is_cuda()) {
      note_device(device.index());
      c10::cuda::CUDAGuard guard(device.index());
      const Capture capture = capture_of(c10::cuda::getCurrentCUDAStream(device.index()).stream());
      TORCH_CHECK(capture != Capture::kActive, "offcache: cannot copy while ", device,
                  "'s current stream is capturing a CUDA graph: the engine's copies and "
                  "host bookkeeping cannot be replayed");
      // The legacy default stream beside a capture on a blocking stream: a consumer that only
      // waits is served (the host waits: CudaEvent::wait_current); a producer's work queued on
      // that stream would join the capture.
      TORCH_CHECK(waits_only || capture != Capture::kElsewhere, "offcache: cannot copy from ",
                  device, "'s legacy default stream while a blocking stream of ", device,
                  " captures a CUDA graph: work queued on the legacy stream would join the "
                  "capture. Produce on a stream of its own (torch.cuda.stream(...)), or copy "
                  "before or after the capture");
    }
    return device;
  }

  EventPtr record_current(c10::Device device) override {
    if (device.is_cpu()) return HostEvent::completed();  // CPU work is synchronous
    note_device(device.index());
    auto event = std::make_shared<CudaEvent>(pools_.at(device.index()), false);
    event->record(c10::cuda::getCurrentCUDAStream(device.index()).stream());
    return event;
  }

  void current_wait(c10::Device device, const EventPtr& event) override {
    if (event == nullptr || wait_chained(device, event)) return;
    if (device.is_cpu() || !as_cuda(event)) {
      if (!event->query()) sync(event);
      return;
    }
    event->wait_current(device.index());
  }

  CopyStream& copy_stream(Dir dir, c10::Device device) override {
    if (device.is_cpu()) return dir == Dir::kStore ? host_d2h_ : host_h2d_;
    note_device(device.index());
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = streams_.at(device.index())[static_cast<int>(dir)];
    if (!slot)
      slot = std::make_unique<CudaCopyStream>(device.index(), pools_[device.index()], counters);
    return *slot;
  }

  EventPtr trace_origin(c10::Device device) override {
    if (device.is_cpu()) return HostEvent::completed();
    note_device(device.index());
    auto event = std::make_shared<CudaEvent>(pools_.at(device.index()), true);
    event->record(c10::cuda::getCurrentCUDAStream(device.index()).stream());
    return event;
  }

  int claim_device() const override { return registration_device(); }

  void prepare_thread() override {
    // Keyed by backend and device: the device is known only once the engine used
    // one, and a thread that ran before (CPU traffic only) made no CUDA call.
    thread_local const CudaBackend* prepared_for = nullptr;
    thread_local int prepared_device = -1;
    thread_local bool relaxed = false;
    if (!in_owner_process()) return;  // a forked child makes no CUDA call
    const int device = home_.load(std::memory_order_acquire);
    if (prepared_for == this && prepared_device == device) return;
    if (prepared_for != this) ++counters.threads_prepared;
    prepared_for = this;
    prepared_device = device;
    if (device < 0) return;
    OFFCACHE_CUDA_CHECK(cudaSetDevice(device));
    if (relaxed) return;
    // A global-mode capture on another thread forbids unsafe calls on every
    // thread that has not relaxed its own mode.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    OFFCACHE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    relaxed = true;
  }

  void hand_over(const at::Tensor& t, c10::Device consumer) override {
    if (!t.is_cuda() || !t.has_storage()) return;
    c10::cuda::CUDACachingAllocator::recordStream(
        t.storage().data_ptr(), c10::cuda::getCurrentCUDAStream(consumer.index()));
  }

  std::shared_ptr<Handoff> handoff(const std::vector<at::Tensor>& outs,
                                   c10::Device consumer) override {
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
    for (const at::Tensor& t : outs) {
      if (t.defined() && t.is_cuda() && t.has_storage())
        storages.push_back(t.storage().getWeakStorageImpl());
    }
    if (storages.empty()) return nullptr;
    return std::make_shared<CudaHandoff>(c10::cuda::getCurrentCUDAStream(consumer.index()),
                                         std::move(storages));
  }

  std::string stream_error() override {
    std::string e = host_d2h_.error();
    return e.empty() ? host_h2d_.error() : e;
  }

  bool packs_outputs(c10::Device consumer) const override {
    // recordStream on a pointer the allocator did not make, as a packed output is: the native
    // caching allocator ignores it, cudaMallocAsync asserts, a pluggable allocator hands it to the
    // user's hook. Only the native one packs.
    return !consumer.is_cuda() || c10::cuda::CUDACachingAllocator::name() == "native";
  }

  bool outputs_fit_copy_stream(c10::Device consumer, size_t bytes) const override {
    // Only the native allocator keys its cached blocks by stream and frees them all, with a device
    // synchronisation, when an allocation would pass its limit (cudaMallocAsync trims its pool
    // instead). A fraction of 1: the limit is the device's memory, unguarded here.
    if (!consumer.is_cuda() || c10::cuda::CUDACachingAllocator::name() != "native") return true;
    const c10::DeviceIndex d = consumer.index();
    const double fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(d);
    if (!(fraction > 0.0 && fraction < 1.0)) return true;
    namespace alloc = c10::CachingDeviceAllocator;
    const alloc::DeviceStats stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d);
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const auto reserved = static_cast<size_t>(stats.reserved_bytes[all].current);
    const auto allocated = static_cast<size_t>(stats.allocated_bytes[all].current);
    const auto limit = static_cast<size_t>(fraction * static_cast<double>(total_memory(d)));
    const size_t need = (bytes + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
    // New memory fits under the limit: a cudaMalloc, no retry. Else the copy stream's pool may
    // lack a block and the retry would follow; cached memory elsewhere (most of it the consumer's)
    // serves the outputs from the consumer's pool. With none cached, both ways end the same.
    return reserved + need <= limit || reserved - allocated < need;
  }

  // GPU `d`'s memory, asked of the runtime once.
  size_t total_memory(c10::DeviceIndex d) const {
    std::lock_guard<std::mutex> lock(totals_mu_);
    if (totals_.empty()) totals_.resize(streams_.size(), 0);
    size_t& total = totals_.at(d);
    if (total == 0) {
      cudaDeviceProp prop{};
      OFFCACHE_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
      total = prop.totalGlobalMem;
    }
    return total;
  }

  uint64_t alloc_retries(c10::Device device) const override {
    if (!device.is_cuda()) return 0;
    namespace alloc = c10::CachingDeviceAllocator;
    const alloc::DeviceStats stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<uint64_t>(stats.num_alloc_retries);
  }

  void enable_peer_access(c10::Device from, c10::Device to) override {
    if (!from.is_cuda() || !to.is_cuda() || from == to) return;
    // Through PyTorch, which also tells its caching allocator (needed for
    // memory from expandable segments); where P2P is impossible the driver
    // stages the copy through the host.
    (void)at::cuda::get_p2p_access(from.index(), to.index());
    (void)at::cuda::get_p2p_access(to.index(), from.index());
  }

 private:
  // The device the engine's threads select: the first one this backend used
  // (a GPU whose context exists already), -1 before.
  void note_device(int device) const {
    int none = -1;
    home_.compare_exchange_strong(none, device, std::memory_order_acq_rel);
  }
  // The device a pinned registration selects: the engine's, else (it has used no GPU yet) the
  // calling thread's current one, claimed; -1 if even that cannot be asked. Never throws.
  int registration_device() const noexcept {
    const int home = home_.load(std::memory_order_acquire);
    if (home >= 0) return home;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1;
    }
    note_device(current);
    return home_.load(std::memory_order_acquire);
  }

  mutable std::atomic<int> home_{-1};
  HostCopyStream host_d2h_;  // CPU-to-CPU traffic
  HostCopyStream host_h2d_;
  PinnedSource pinned_;
  CountedChunks counted_{pinned_, counters};
  pid_t owner_pid_;
  uint64_t generation_;  // fork_generation() when made: another value means a forked child
  std::mutex mu_;
  std::vector<std::shared_ptr<EventPool>> pools_;
  std::vector<std::array<std::unique_ptr<CudaCopyStream>, 2>> streams_;
  const c10::Allocator* pinned_allocator_ = nullptr;
  mutable std::mutex totals_mu_;
  mutable std::vector<size_t> totals_;  // total_memory()'s, per device (0: not asked yet)
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int64_t host_copy_delay_us) {
  return std::make_unique<CudaBackend>(host_copy_delay_us);
}

int cuda_device_count() { return c10::cuda::device_count(); }

}  // namespace offcache
