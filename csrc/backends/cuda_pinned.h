// Pinned host memory on CUDA (the CUDA backend's, backend_cuda.cpp): the arena's chunks and
// offcache.weights.node's shared mappings registered with cudaHostRegister, and what a fork does
// to them. Registrations run on callers' threads (a store or fetch, a storage deleter,
// synchronize, empty_cache, the thread deleting a retired engine): each selects the engine's
// device and relaxes the thread's capture mode for the call only.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "backend.h"
#include "core/page_source.h"

namespace offcache {

// cudaHostRegister / cudaHostUnregister of memory that is not a chunk of ours (the weights'
// shared mappings, csrc/region/) on `device` (-1: the current one) in relaxed capture mode; false
// and `error` (the call and the driver's reason) on failure, the error cleared.
bool cuda_register_host(void* ptr, size_t bytes, int device, std::string* error);
bool cuda_unregister_host(void* ptr, int device, std::string* error) noexcept;

// For its scope, on the calling thread: `device` selected (none if < 0) and the capture mode
// relaxed, both restored after. A thread whose current device is another (a Python thread on
// GPU 0 of a rank on cuda:1, a deleter thread) then makes no context there, and a graph capture
// in global or thread-local mode (this thread's or another's) neither fails the call nor is
// invalidated by it. Never throws: what cannot be exchanged is left as it was (device_ok()).
class PinnedCallScope {
 public:
  explicit PinnedCallScope(int device) noexcept;
  ~PinnedCallScope();
  PinnedCallScope(const PinnedCallScope&) = delete;
  PinnedCallScope& operator=(const PinnedCallScope&) = delete;
  bool device_ok() const { return device_ok_; }

 private:
  std::optional<c10::cuda::CUDAGuard> guard_;  // restored last
  bool device_ok_ = true;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool relaxed_ = false;
};

// Bumped in a forked child (atfork): a CUDA backend made before sees another value.
uint64_t fork_generation();

// Pinned chunks: page-touched anonymous memory registered with the driver, much cheaper per GiB
// than cudaHostAlloc. Registration failure (memlock limits) returns nullptr so the engine spills
// instead of crashing. A forked child's copies of the chunks are PROT_NONE (their pages are
// wiped: a read faults instead of giving zeros).
class PinnedSource : public ChunkSource {
 public:
  // device(): the engine's device, selected around each registration (it claims the calling
  // thread's current one where the engine has used no GPU yet); -1 if none can be had.
  PinnedSource(Counters& counters, std::function<int()> device);
  void* allocate(size_t bytes, std::string* error) override;
  void release(void* ptr, size_t bytes) noexcept override;
  bool pinned() const override { return true; }

 private:
  // cudaHostUnregister on the engine's device in relaxed capture mode; on failure the chunk is
  // counted (chunks_kept_registered), one warning is printed, and false returned.
  bool unregister(void* ptr) noexcept;

  Counters& counters_;
  std::function<int()> device_;
  PageSource pages_;
};

}  // namespace offcache
