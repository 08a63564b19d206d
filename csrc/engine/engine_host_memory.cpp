// The engine's host memory: a block for a store (the pinned arena, a dropped
// value's block taken in stream order, the host snapshots' staging, pageable
// spill, the disk tier past the host limit), within the host limit at every
// moment, and a freed block back to the pool it came from.
#include <algorithm>
#include <chrono>
#include <string>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

void Engine::free_block(const Block& block) {
  if (block.chunk == kPageableChunk) {
    pageable_.release(block.ptr, block.size);
    stats_.pageable_bytes -= block.size;
  } else if (block.chunk == kBounceChunk) {
    if (bounce_pool_bytes_ + block.size <= kBouncePoolBytes) {
      bounce_pool_.push_back(block);
      bounce_pool_bytes_ += block.size;
    } else {
      pageable_.release(block.ptr, block.size);
    }
  } else if (block.chunk == kRingChunk) {
    backend_->chunks().release(block.ptr, block.size);
  } else if (from_bounce_arena(block)) {
    Block b = block;
    b.chunk &= ~kBounceArenaBit;
    bounce_arena_->free(b);
  } else if (from_staging_arena(block)) {
    Block b = block;
    b.chunk &= ~kStagingArenaBit;
    staging_arena_->free(b);
  } else if (on_disk(block)) {
    Block b = block;
    b.chunk &= ~kDiskChunkBit;
    disk_arena_->free(b);
  } else {
    arena_.free(block);
  }
}

size_t Engine::host_held_locked() const {
  // Every byte of host memory that holds values, snapshot staging and blocks
  // waiting on their copies included (the disk tier's I/O buffers are bounded apart).
  return arena_.in_use_bytes() + staging_arena_->in_use_bytes() + stats_.pageable_bytes;
}

size_t Engine::host_need(size_t bytes) const {
  // What a block of `bytes` may take: an arena block or a page-rounded pageable one.
  return std::max(arena_.round_up(bytes), align_up(std::max<size_t>(bytes, 1), 4096));
}

bool Engine::wait_for_host_room(size_t bytes, size_t* held) {
  const size_t limit = disk_options_.host_limit;
  const auto fits = [&] {
    *held = host_held_locked();
    return *held + bytes >= *held && *held + bytes <= limit;
  };
  {
    auto l = lock();
    reclaim_locked();
    if (fits()) return true;
  }
  for (;;) {
    {
      Retire r = retiring();
      reap_locked(r);
    }  // the staging of copies seen complete dies here, unlocked, and is freed
    EventPtr oldest;
    {
      auto l = lock();
      reclaim_locked();
      if (fits()) return true;
      // Memory that copies in flight free when they complete: a snapshot's
      // staging (only stores use it: the oldest store first), then blocks
      // waiting on their copies.
      if (staging_bytes_ > 0) oldest = in_flight_.oldest(static_cast<int>(Dir::kStore));
      if (!oldest && deferred_.bytes_where([](const Block& b) {
            return b.chunk == kPageableChunk || in_value_arena(b);
          }) > 0) {
        oldest = deferred_.oldest_fence();
      }
      if (!oldest) return false;  // nothing pending can make room
    }
    backend_->sync(oldest);
  }
}

HostBlock* Engine::allocate_host(size_t bytes, bool allow_spill, bool staging,
                                 std::vector<EventPtr>* write_after) {
  // The host limit holds for every block of host memory, a snapshot's staging
  // included: past it, a store first waits for the copies whose completion
  // frees memory; then a value goes to disk (with a disk tier) or raises
  // HostLimitError, and staging is skipped (nullptr: the copy reads the source).
  const size_t need = host_need(bytes);
  for (;;) {
    if (disk_ && allow_spill && !staging) {  // a snapshot's staging never goes to disk
      // Placement: first come stays in memory. Past the host limit, new values
      // go to disk; nothing moves between tiers later.
      if (std::optional<Block> b = allocate_disk(bytes)) {
        auto hb = std::make_unique<HostBlock>();
        hb->owner = this;
        hb->block = *b;
        auto l = lock();
        lifetime_.add_block();
        note_peaks_locked();
        return hb.release();
      }
    } else {
      size_t held = 0;
      if (!wait_for_host_room(need, &held)) {
        if (staging || !allow_spill) return nullptr;
        // No disk tier: the host limit still holds (a run is refused, not killed).
        throw HostLimitError(
            "offcache: storing " + std::to_string(bytes) +
            " more bytes would take host memory past the host limit of " +
            std::to_string(disk_options_.host_limit) + " bytes (" + std::to_string(held) +
            " in use, pinned + pageable); values stored earlier are intact. Raise "
            "OFFCACHE_HOST_LIMIT, or set OFFCACHE_DISK_DIR to a folder on local disk for the "
            "values past it");
      }
    }
    bool retry = false;
    HostBlock* hb = allocate_in_memory(bytes, allow_spill, staging, &retry, write_after);
    if (!retry) return hb;
  }
}

HostBlock* Engine::allocate_in_memory(size_t bytes, bool allow_spill, bool staging, bool* retry,
                                      std::vector<EventPtr>* write_after) {
  std::string why;
  std::optional<Block> block;
  std::vector<EventPtr> fences;  // a taken pending block's: the writer's copy follows them
  Arena& arena = staging ? *staging_arena_ : arena_;
  ChunkSource& source = staging ? static_cast<ChunkSource&>(pageable_) : backend_->chunks();
  for (;;) {
    EventPtr oldest;
    size_t chunk = 0;
    {
      auto l = lock();
      reclaim_locked();
      block = arena.allocate_existing(bytes);
      if (block) break;
      if (write_after != nullptr && !staging) {
        // A dropped value's block whose copies are still in flight: a copy
        // stream may write it in stream order behind them, where a new chunk
        // would cost a registration (milliseconds) and memory. At most a
        // quarter larger than the request, so a small value never holds a
        // large block.
        const size_t need = arena_.round_up(bytes);
        if (auto taken = deferred_.take_fitting([&](const Block& b) {
              return in_value_arena(b) && b.size >= need && b.size - need <= need / 4;
            })) {
          block = taken->block;
          fences = std::move(taken->fences);
          break;
        }
      }
      // Within the budget the arena grows: the host never waits for a copy
      // while it could run ahead. Past it, memory waiting on copies counts as
      // available when it could hold the request: wait (unlocked) for the
      // oldest pending block's copies, then try again.
      chunk = arena.begin_chunk(bytes, &why);
      if (chunk == 0 && !staging &&
          deferred_.bytes_where(in_value_arena) >= arena_.round_up(bytes)) {
        oldest = deferred_.oldest_fence();
      }
    }
    if (oldest) {
      backend_->sync(oldest);
      continue;
    }
    if (chunk == 0) break;  // over budget
    // A new chunk: mmap, pre-fault and (CUDA) cudaHostRegister, without the
    // lock, so threads freeing tensors meanwhile do not wait on it.
    const auto t0 = std::chrono::steady_clock::now();
    void* base = source.allocate(chunk, &why);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto l = lock();
    arena.finish_chunk(base, chunk);
    if (base != nullptr && !staging) {
      stats_.chunk_seconds += seconds;
      stats_.chunk_bytes += chunk;
    }
    block = arena.allocate_existing(bytes);
    if (block || base == nullptr) break;
  }
  if (block && staging) block->chunk |= kStagingArenaBit;
  auto hb = std::make_unique<HostBlock>();
  hb->owner = this;
  auto l = lock();
  const size_t size = align_up(std::max<size_t>(bytes, 1), 4096);  // a pageable block's
  // The room seen before the lock was dropped may have gone to another thread meanwhile:
  // checked again here, where the block is committed.
  const size_t held = host_held_locked() + (block ? 0 : size);
  if (held > disk_options_.host_limit && (block || allow_spill)) {
    if (block && !fences.empty()) {
      deferred_.push(*block, std::move(fences));  // still the copies' until they complete
    } else if (block) {
      free_block(*block);
    }
    *retry = true;
    return nullptr;
  }
  if (block) {
    hb->block = *block;
    if (!fences.empty()) {
      // The block keeps the copies' fences too: should its value die before the
      // writer's copy is issued, it is still freed only after them.
      ++stats_.blocks_reused_in_order;
      hb->fences = fences;
      *write_after = std::move(fences);
    }
  } else {
    if (!allow_spill) return nullptr;
    // Past the budget, or the OS refused to pin: spill to pageable memory.
    void* p = pageable_.allocate(size, &why);
    TORCH_CHECK(p != nullptr, "offcache: out of host memory for ", bytes, " bytes: ", why);
    hb->block = Block{p, size, kPageableChunk, 0};
    stats_.pageable_bytes += size;
    if (!staging) ++stats_.spills;
    if (!spill_warned_ && !staging) {
      spill_warned_ = true;
      spill_notice_ = "offcache: pinned arena unavailable (" + why +
                      "); spilling to pageable host memory, copies will be slower";
    }
  }
  hb->staging = staging;
  if (staging) staging_bytes_ += hb->block.size;
  lifetime_.add_block();
  note_peaks_locked();
  return hb.release();
}

}  // namespace offcache
