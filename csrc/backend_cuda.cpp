// CUDA backend: dedicated D2H and H2D streams per device, CUDA events,
// cudaMemcpyAsync, and pinned chunks made by cudaHostRegister on pre-touched
// pages. CPU-only traffic is delegated to the host backend.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <unistd.h>

#include <array>
#include <mutex>

#include "backend_host.h"
#include "cuda_check.h"

namespace offcache {
namespace {

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, bool timed) : device_(device) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    OFFCACHE_CUDA_CHECK(
        cudaEventCreateWithFlags(&event_, timed ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    // Destructors cannot throw; at interpreter exit the context may be gone.
    if (cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
  }
  void record(cudaStream_t stream) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    OFFCACHE_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  bool query() override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    OFFCACHE_CUDA_CHECK(err);
    return true;
  }
  void wait() override { OFFCACHE_CUDA_CHECK(cudaEventSynchronize(event_)); }
  double elapsed_ms_since(Event& start) override {
    auto* s = dynamic_cast<CudaEvent*>(&start);
    if (s == nullptr) return 0.0;
    float ms = 0;
    const cudaError_t err = cudaEventElapsedTime(&ms, s->event_, event_);
    if (err != cudaSuccess) {  // an untimed event: no figure, not an error
      (void)cudaGetLastError();
      return 0.0;
    }
    return ms;
  }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

// Pinned chunks: page-touched anonymous memory registered with the driver,
// much cheaper per GiB than cudaHostAlloc. Registration failure (memlock
// limits) returns nullptr so the engine spills instead of crashing.
class PinnedSource : public ChunkSource {
 public:
  void* allocate(size_t bytes, std::string* error) override {
    void* p = pages_.allocate(bytes, error);
    if (p == nullptr) return nullptr;
    const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      pages_.release(p, bytes);
      if (error) {
        *error = std::string("cudaHostRegister of ") + std::to_string(bytes) +
                 " bytes failed: " + cudaGetErrorString(err);
      }
      return nullptr;
    }
    return p;
  }
  void release(void* ptr, size_t bytes) noexcept override {
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
    pages_.release(ptr, bytes);
  }
  bool pinned() const override { return true; }

 private:
  PageSource pages_;
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int64_t host_copy_delay_us)
      : host_(host_copy_delay_us), owner_pid_(getpid()) {
    streams_.resize(c10::cuda::device_count());
  }
  std::string name() const override { return "cuda"; }
  ChunkSource& chunks() override { return pinned_; }
  const ChunkSource& chunks() const override { return pinned_; }

  c10::Device resolve_device(c10::Device device) const override {
    TORCH_CHECK(getpid() == owner_pid_, "offcache: the CUDA engine was created in process ",
                owner_pid_,
                " and cannot be used in a forked child; use the 'spawn' start method, or "
                "OFFCACHE_BACKEND=host in the child");
    TORCH_CHECK(device.is_cpu() || device.is_cuda(), "offcache: unsupported device ", device);
    if (device.is_cuda() && !device.has_index()) {
      device = c10::Device(c10::kCUDA, c10::cuda::current_device());
    }
    TORCH_CHECK(device.is_cpu() || device.index() < static_cast<int>(streams_.size()),
                "offcache: no such CUDA device ", device);
    return device;
  }

  EventPtr record_current(c10::Device device) override {
    if (device.is_cpu()) return host_.record_current(device);
    auto event = std::make_shared<CudaEvent>(device.index(), false);
    event->record(c10::cuda::getCurrentCUDAStream(device.index()).stream());
    return event;
  }

  void current_wait(c10::Device device, const EventPtr& event) override {
    if (device.is_cpu() || !as_cuda(event)) return event->wait();
    c10::cuda::CUDAGuard guard(device.index());
    OFFCACHE_CUDA_CHECK(cudaStreamWaitEvent(
        c10::cuda::getCurrentCUDAStream(device.index()).stream(), as_cuda(event)->get(), 0));
  }

  void copy_wait(Dir dir, c10::Device device, const EventPtr& event) override {
    if (device.is_cpu()) return host_.copy_wait(dir, device, event);
    if (!as_cuda(event)) return event->wait();  // produced by a host thread
    c10::cuda::CUDAGuard guard(device.index());
    OFFCACHE_CUDA_CHECK(cudaStreamWaitEvent(stream(dir, device), as_cuda(event)->get(), 0));
  }

  void copy(Dir dir, c10::Device device, const std::vector<CopyOp>& ops) override {
    if (device.is_cpu()) return host_.copy(dir, device, ops);
    c10::cuda::CUDAGuard guard(device.index());
    cudaStream_t s = stream(dir, device);
    if (dir == Dir::kStore && ops.size() >= kGatherMin) return copy_gathered(device, s, ops);
    for (const auto& op : ops) {
      OFFCACHE_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDefault, s));
    }
  }

  EventPtr copy_record(Dir dir, c10::Device device, bool timed) override {
    if (device.is_cpu()) return host_.copy_record(dir, device, timed);
    auto event = std::make_shared<CudaEvent>(device.index(), timed);
    event->record(stream(dir, device));
    return event;
  }

  EventPtr trace_origin(c10::Device device) override {
    if (device.is_cpu()) return host_.trace_origin(device);
    auto event = std::make_shared<CudaEvent>(device.index(), /*timed=*/true);
    event->record(c10::cuda::getCurrentCUDAStream(device.index()).stream());
    return event;
  }

  void host_callback(Dir dir, c10::Device device, std::function<void()> fn) override {
    if (device.is_cpu()) return host_.host_callback(dir, device, std::move(fn));
    auto* heap = new std::function<void()>(std::move(fn));
    c10::cuda::CUDAGuard guard(device.index());
    const cudaError_t err = cudaLaunchHostFunc(
        stream(dir, device),
        [](void* p) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
          (*f)();
        },
        heap);
    if (err != cudaSuccess) delete heap;
    OFFCACHE_CUDA_CHECK(err);
  }

  void mark_used_by_copy(Dir dir, c10::Device device, const at::Tensor& t) override {
    if (device.is_cpu() || !t.is_cuda()) return;
    auto s = c10::cuda::getStreamFromExternal(stream(dir, device), device.index());
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
  }

 private:
  static constexpr size_t kGatherMin = 8;
  static constexpr size_t kGatherMaxBytes = size_t{1} << 20;

  static CudaEvent* as_cuda(const EventPtr& e) { return dynamic_cast<CudaEvent*>(e.get()); }

  cudaStream_t stream(Dir dir, c10::Device device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pair = streams_.at(device.index());
    cudaStream_t& s = pair[static_cast<int>(dir)];
    if (s == nullptr) {
      c10::cuda::CUDAGuard guard(device.index());
      int least = 0, greatest = 0;
      OFFCACHE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      OFFCACHE_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    }
    return s;
  }

  // Many small device-to-host copies: gather them on the copy stream into one
  // device staging buffer laid out like their (packed) destination block, then
  // issue a single D2H copy: one ~2 us call instead of one per tensor. The
  // engine only batches kStore ops whose sources live on `device`.
  void copy_gathered(c10::Device device, cudaStream_t s, const std::vector<CopyOp>& ops) {
    std::vector<CopyOp> small, rest;
    for (const auto& op : ops) (op.bytes < kGatherMaxBytes ? small : rest).push_back(op);
    std::sort(small.begin(), small.end(),
              [](const CopyOp& a, const CopyOp& b) { return a.dst < b.dst; });
    size_t payload = 0, max_gap = 0;
    for (size_t i = 0; i < small.size(); ++i) {
      payload += small[i].bytes;
      if (i > 0) {
        const auto gap = static_cast<const char*>(small[i].dst) -
                         (static_cast<const char*>(small[i - 1].dst) + small[i - 1].bytes);
        TORCH_INTERNAL_ASSERT(gap >= 0, "offcache: overlapping copy destinations");
        max_gap = std::max<size_t>(max_gap, static_cast<size_t>(gap));
      }
    }
    char* lo = small.empty() ? nullptr : static_cast<char*>(small.front().dst);
    const size_t span =
        small.empty() ? 0 : static_cast<char*>(small.back().dst) + small.back().bytes - lo;
    if (small.size() < kGatherMin || span > 2 * payload + 4096) {
      rest = ops;  // not dense enough to be worth a gather
      small.clear();
    }
    if (!small.empty()) {
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(s, device.index()));
      const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
      at::Tensor staging = at::empty({static_cast<int64_t>(span)}, bytes);
      at::Tensor pad = at::empty({static_cast<int64_t>(std::max<size_t>(max_gap, 1))}, bytes);
      std::vector<at::Tensor> parts;
      parts.reserve(small.size() * 2);
      const char* cursor = lo;
      for (const auto& op : small) {
        const auto gap = static_cast<const char*>(op.dst) - cursor;
        if (gap > 0) parts.push_back(pad.narrow(0, 0, gap));  // padding: contents unused
        parts.push_back(
            at::from_blob(const_cast<void*>(op.src), {static_cast<int64_t>(op.bytes)}, bytes));
        cursor = static_cast<const char*>(op.dst) + op.bytes;
      }
      at::cat_out(staging, parts);
      OFFCACHE_CUDA_CHECK(cudaMemcpyAsync(lo, staging.data_ptr(), span, cudaMemcpyDeviceToHost, s));
      // staging and pad are freed on their own stream, after the copy in stream order.
    }
    for (const auto& op : rest) {
      OFFCACHE_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDefault, s));
    }
  }

  HostBackend host_;
  PinnedSource pinned_;
  pid_t owner_pid_;
  std::mutex mu_;
  std::vector<std::array<cudaStream_t, 2>> streams_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int64_t host_copy_delay_us) {
  return std::make_unique<CudaBackend>(host_copy_delay_us);
}

int cuda_device_count() { return c10::cuda::device_count(); }

}  // namespace offcache
