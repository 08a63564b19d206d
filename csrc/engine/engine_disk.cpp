// The engine's disk tier: placing blocks in files, and the I/O thread's
// writes and reads. A disk block's bytes go memory -> bounce -> file on
// store, and file -> bounce -> destination on fetch, kDiskPiece at a time.
#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

namespace {

int64_t ns_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
      .count();
}

}  // namespace

std::optional<Block> Engine::allocate_disk(size_t bytes) {
  // Placement: first come stays in memory. Past the host limit, new values go
  // to disk; nothing moves between tiers later.
  std::optional<Block> block;
  for (;;) {
    size_t chunk = 0;
    std::string why;
    // Host memory in use counts snapshot staging and blocks waiting on copies:
    // the limit holds at its peak. Memory that copies in flight are about to free
    // is waited for first, so a value goes to disk only past the limit for good.
    size_t held = 0;
    if (wait_for_host_room(host_need(bytes), &held)) return std::nullopt;
    {
      auto l = lock();
      reclaim_locked();
      if (!io_) {  // the I/O thread starts with the first disk block
        l.unlock();
        io_stream(io_);
        continue;
      }
      block = disk_arena_->allocate_existing(bytes);
      if (block) {
        block->chunk |= kDiskChunkBit;
        if (!disk_warned_) {
          disk_warned_ = true;
          spill_notice_ = "offcache: host memory reached the host limit (" +
                          std::to_string(disk_options_.host_limit) +
                          " bytes); values now go to disk in " + disk_->dir() +
                          ", fetches read them back";
        }
        return block;
      }
      chunk = disk_arena_->begin_chunk(bytes, &why);
    }
    // A new file (create, reserve, map) without the lock.
    void* base = chunk ? disk_->allocate(chunk, &why) : nullptr;
    size_t in_use;
    {
      auto l = lock();
      if (chunk) disk_arena_->finish_chunk(base, chunk);
      in_use = disk_arena_->in_use_bytes();
    }
    TORCH_CHECK(base != nullptr, "offcache: the disk tier cannot take ", bytes,
                " more bytes (folder ", disk_->dir(), ", ", in_use,
                " bytes on disk already): ", why,
                ". Values stored earlier are intact; free disk space, choose another "
                "OFFCACHE_DISK_DIR or raise OFFCACHE_HOST_LIMIT");
  }
}

HostStream& Engine::io_stream(std::unique_ptr<HostStream>& slot) {
  {
    auto l = lock();
    if (slot) return *slot;
  }
  // Made unlocked: a stream registers for fork handling, which takes its lock before ours.
  auto io = std::make_unique<HostStream>([this] { backend_->prepare_thread(); });
  {
    auto l = lock();
    if (!slot) slot = std::move(io);  // set once; later uses follow a lock() that saw it
  }
  return *slot;  // a stream that lost the race is destroyed here, unlocked
}

Block Engine::allocate_bounce(size_t bytes, char** aligned) {
  // The bounce arena: pinned on CUDA and outside the pinned budget, which is
  // full exactly when the disk tier is in use, so the device copy into it stays
  // asynchronous. Its chunks are made without the lock.
  std::string why;
  for (;;) {
    size_t chunk = 0;
    {
      auto l = lock();
      reclaim_locked();
      if (auto b = bounce_arena_->allocate_existing(bytes)) {
        *aligned = static_cast<char*>(b->ptr);
        b->chunk |= kBounceArenaBit;
        return *b;
      }
      chunk = bounce_arena_->begin_chunk(bytes, &why);
      if (chunk == 0) return allocate_pageable_bounce_locked(bytes, aligned);
    }
    void* base = backend_->chunks().allocate(chunk, &why);
    auto l = lock();
    bounce_arena_->finish_chunk(base, chunk);
    if (base == nullptr) return allocate_pageable_bounce_locked(bytes, aligned);
  }
}

Block Engine::allocate_pageable_bounce_locked(size_t bytes, char** aligned) {
  // Past the bounce arena: a pooled page-aligned buffer (the smallest that fits), else a new one.
  ++stats_.bounce_pageable;
  std::string why;
  const size_t size = align_up(std::max<size_t>(bytes, 1), kDiskAlign);
  auto best = bounce_pool_.end();
  for (auto it = bounce_pool_.begin(); it != bounce_pool_.end(); ++it) {
    if (it->size >= size && (best == bounce_pool_.end() || it->size < best->size)) best = it;
  }
  if (best != bounce_pool_.end()) {
    Block b = *best;
    bounce_pool_.erase(best);
    bounce_pool_bytes_ -= b.size;
    *aligned = static_cast<char*>(b.ptr);
    return b;
  }
  void* p = pageable_.allocate(size, &why);
  TORCH_CHECK(p != nullptr, "offcache: out of host memory for a ", bytes,
              "-byte disk buffer: ", why);
  *aligned = static_cast<char*>(p);
  return Block{p, size, kBounceChunk, 0};
}

EventPtr Engine::write_to_disk(HostBlock* hb, const Block& bounce, const char* data, size_t bytes,
                               const EventPtr& after) {
  const size_t n = align_up(bytes, kDiskAlign);  // the disk block is kDiskAlign-aligned
  TORCH_INTERNAL_ASSERT(n <= hb->block.size, "offcache: disk block of ", hb->block.size,
                        " bytes for a ", n, "-byte write");
  const DiskSource::Where where = disk_->locate(hb->block.ptr);
  TORCH_INTERNAL_ASSERT(where.fd >= 0, "offcache: a disk block outside every disk file");
  io_->wait_event(after);
  io_->submit([this, where, data, n] {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t off = 0; off < n; off += kDiskPiece) {
      const size_t len = std::min(kDiskPiece, n - off);
      DiskSource::Where w = where;
      w.offset += static_cast<off_t>(off);
      std::string why;
      bool buffered = false;
      // The space was reserved when the block was placed, so a failure here is
      // an I/O error: reported by the next engine call (HostStream keeps it),
      // never retried through the mapping, where it would fault.
      if (!disk_write(w, data + off, len, &why, &buffered))
        throw std::runtime_error("writing to the disk tier in " + disk_->dir() + ": " + why);
      if (buffered) ++disk_fallbacks_;
    }
    disk_write_bytes_ += n;
    disk_write_ns_ += ns_since(t0);
  });
  EventPtr written = io_->record();
  InFlightLedger<Tensors>::Batch batch;
  batch.done = written;
  batch.bytes = n;
  batch.dir = static_cast<int>(Dir::kStore);
  batch.stream = io_.get();
  auto l = lock();
  in_flight_.add(std::move(batch));
  deferred_.push(bounce, {written});
  return written;
}

void Engine::read_from_disk(const char* src, size_t bytes, char* dst) {
  // `dst` is kDiskAlign-aligned and holds the aligned span around [src, src + bytes).
  DiskSource::Where where = disk_->locate(src);
  TORCH_INTERNAL_ASSERT(where.fd >= 0, "offcache: a disk read outside every disk file");
  const size_t shift = static_cast<size_t>(where.offset) % kDiskAlign;
  where.offset -= static_cast<off_t>(shift);
  const size_t n = align_up(shift + bytes, kDiskAlign);
  for (size_t off = 0; off < n; off += kDiskPiece) {
    const size_t len = std::min(kDiskPiece, n - off);
    io_->submit([this, where, dst, off, len] {
      const auto t0 = std::chrono::steady_clock::now();
      DiskSource::Where w = where;
      w.offset += static_cast<off_t>(off);
      std::string why;
      bool buffered = false;
      if (!disk_read(w, dst + off, len, &why, &buffered))
        throw std::runtime_error("reading from the disk tier in " + disk_->dir() + ": " + why);
      if (buffered) ++disk_fallbacks_;
      disk_read_bytes_ += len;
      disk_read_ns_ += ns_since(t0);
    });
  }
}

}  // namespace offcache
