// The engine's disk tier: placing blocks in files, and the I/O thread's
// writes and reads. A disk block's bytes go memory -> bounce -> file on
// store, and file -> bounce -> destination on fetch, kDiskPiece at a time.
#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>

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
    std::unique_ptr<HostStream> io;
    {
      auto l = lock();
      reclaim_locked();
      // Snapshot staging is transient: it does not count towards the limit.
      if (arena_.in_use_bytes() + stats_.pageable_bytes - staging_bytes_ + bytes <=
          disk_options_.host_limit) {
        return std::nullopt;
      }
      if (!io_) {
        // The I/O thread starts with the first disk block, made unlocked (a
        // stream registers for fork handling, which takes its lock before ours).
        l.unlock();
        io = std::make_unique<HostStream>();
        l.lock();
        if (!io_) io_ = std::move(io);  // set once; later uses follow a lock() that saw it
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

Block Engine::allocate_bounce_locked(size_t bytes, char** aligned) {
  std::string why;
  if (backend_->chunks().pinned()) {
    // CUDA: pinned arena memory when the budget allows, so the device copy is asynchronous.
    if (auto b = arena_.allocate(bytes + kDiskAlign, &why)) {
      *aligned = reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(b->ptr), kDiskAlign));
      return *b;
    }
  }
  // A pooled page-aligned buffer (the smallest that fits), else a new one.
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
  char* mapped = static_cast<char*>(hb->block.ptr);
  io_->wait_event(after);
  io_->submit([this, where, data, n, mapped] {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t off = 0; off < n; off += kDiskPiece) {
      const size_t len = std::min(kDiskPiece, n - off);
      DiskSource::Where w = where;
      w.offset += static_cast<off_t>(off);
      if (!disk_write(w, data + off, len, nullptr)) {
        // The space is reserved (fallocate): write through the mapping instead.
        std::memcpy(mapped + off, data + off, len);
        ++disk_fallbacks_;
      }
    }
    disk_write_bytes_ += n;
    disk_write_ns_ += ns_since(t0);
  });
  EventPtr written = io_->record();
  auto l = lock();
  in_flight_.push_back(InFlight{nullptr, written, n, Dir::kStore, {}});
  stats_.in_flight_bytes += n;
  deferred_.push(bounce, {written});
  return written;
}

std::vector<EventPtr> Engine::read_from_disk(const char* src, size_t bytes, char* dst) {
  // `dst` is kDiskAlign-aligned and holds the aligned span around [src, src + bytes).
  DiskSource::Where where = disk_->locate(src);
  TORCH_INTERNAL_ASSERT(where.fd >= 0, "offcache: a disk read outside every disk file");
  const size_t shift = static_cast<size_t>(where.offset) % kDiskAlign;
  where.offset -= static_cast<off_t>(shift);
  const char* mapped = src - shift;
  const size_t n = align_up(shift + bytes, kDiskAlign);
  std::vector<EventPtr> pieces;
  for (size_t off = 0; off < n; off += kDiskPiece) {
    const size_t len = std::min(kDiskPiece, n - off);
    io_->submit([this, where, mapped, dst, off, len] {
      const auto t0 = std::chrono::steady_clock::now();
      DiskSource::Where w = where;
      w.offset += static_cast<off_t>(off);
      if (!disk_read(w, dst + off, len, nullptr)) {
        std::memcpy(dst + off, mapped + off, len);  // through the page cache
        ++disk_fallbacks_;
      }
      disk_read_bytes_ += len;
      disk_read_ns_ += ns_since(t0);
    });
    pieces.push_back(io_->record());
  }
  return pieces;
}

}  // namespace offcache
