// The engine's mutex, and the chunk source of the arenas it guards: a chunk
// given back while the mutex is held (an arena's empty chunk: on CUDA a
// cudaHostUnregister and an munmap, milliseconds each) is queued, and released
// by unlock() once the mutex is free, so no thread waits on it for that.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "core/arena.h"

namespace offcache {

class EngineMutex {
 public:
  void lock() { mu_.lock(); }
  bool try_lock() { return mu_.try_lock(); }
  // Unlocks, then releases the chunks queued while it was held (none are left
  // queued with the mutex free).
  void unlock() noexcept {
    if (queued_.empty()) {
      mu_.unlock();
      return;
    }
    std::vector<Queued> now;
    now.swap(queued_);
    mu_.unlock();
    for (const Queued& q : now) q.source->release(q.ptr, q.bytes);
  }
  // Needs the mutex held. Released at once, under it, if the queue cannot grow.
  void release_after_unlock(ChunkSource& source, void* ptr, size_t bytes) noexcept {
    try {
      queued_.push_back(Queued{&source, ptr, bytes});
    } catch (...) {
      source.release(ptr, bytes);
    }
  }

 private:
  struct Queued {
    ChunkSource* source;
    void* ptr;
    size_t bytes;
  };
  std::mutex mu_;
  std::vector<Queued> queued_;  // guarded by mu_
};

// `source`, whose releases wait for `mu`'s unlock. An arena using it is only
// called with `mu` held, except by its destructor: release_now() first.
class ReleaseUnlocked final : public ChunkSource {
 public:
  ReleaseUnlocked(ChunkSource& source, EngineMutex& mu) : source_(source), mu_(mu) {}
  void* allocate(size_t bytes, std::string* error) override {
    return source_.allocate(bytes, error);
  }
  void release(void* ptr, size_t bytes) noexcept override {
    if (now_) {
      source_.release(ptr, bytes);
    } else {
      mu_.release_after_unlock(source_, ptr, bytes);
    }
  }
  bool pinned() const override { return source_.pinned(); }
  void release_now() { now_ = true; }

 private:
  ChunkSource& source_;
  EngineMutex& mu_;
  bool now_ = false;
};

}  // namespace offcache
