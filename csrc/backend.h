// The primitives that differ between the CUDA and host backends. Everything
// else (arena, dedup, fences, deferred frees, batching, in-flight bounds)
// lives in the engine and is shared. A "stream" here is a CUDA stream or a
// host worker thread; an event is a CUDA event or a completion flag.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/event.h"

namespace offcache {

enum class Dir { kStore = 0, kFetch = 1 };  // D2H, H2D

struct CopyOp {
  void* dst;
  const void* src;
  size_t bytes;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Source of the arena's chunks: pinned on CUDA, plain memory on host.
  virtual ChunkSource& chunks() = 0;
  virtual const ChunkSource& chunks() const = 0;
  // `device` with its index filled in ("cuda" -> the current CUDA device);
  // raises a clear error if this backend cannot serve it.
  virtual c10::Device resolve_device(c10::Device device) const = 0;

  // Event on the calling thread's current stream of `device`: the producer
  // of a store, the consumer of a fetch.
  virtual EventPtr record_current(c10::Device device) = 0;
  // The current stream of `device` waits for `event` before later work.
  virtual void current_wait(c10::Device device, const EventPtr& event) = 0;

  // Copy stream of `device` for direction `dir`.
  virtual void copy_wait(Dir dir, c10::Device device, const EventPtr& event) = 0;
  virtual void copy(Dir dir, c10::Device device, const std::vector<CopyOp>& ops) = 0;
  virtual EventPtr copy_record(Dir dir, c10::Device device, bool timed) = 0;
  // A timed event on the current stream of `device`: the zero of a copy trace.
  virtual EventPtr trace_origin(c10::Device device) = 0;
  // Runs `fn` on a host thread once the copy stream reaches this point. `fn`
  // must not call CUDA (cudaLaunchHostFunc rules).
  virtual void host_callback(Dir dir, c10::Device device, std::function<void()> fn) = 0;
  // Tells the device allocator that `t` is used on the copy stream, so its
  // memory is not handed out again before that use completes.
  virtual void mark_used_by_copy(Dir dir, c10::Device device, const at::Tensor& t) = 0;
};

// True when the CUDA backend was compiled in (chosen in backend_select.cpp).
bool cuda_compiled();

}  // namespace offcache
