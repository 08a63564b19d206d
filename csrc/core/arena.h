// Host arena: reserves large chunks from a ChunkSource (pinned memory on the
// CUDA backend, plain memory on the host backend) and sub-allocates
// exact-size aligned blocks from them. No power-of-two rounding: a block
// costs its size rounded up to the alignment. Free neighbours coalesce.
// Empty chunks are kept as spares up to a quarter of the bytes in use (at
// least the largest one), so a working set that shrinks and grows again does
// not pin its pages anew; and, for a while after a burst, up to the burst's
// peak: stores whose results die while their copies are in flight need a new
// chunk each, and pinning them again on every burst cost a measured 4x of
// D2H bandwidth on an H200. Not thread-safe: the engine serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace offcache {

class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  // Returns nullptr when the memory cannot be had; never throws. `error`
  // receives a short reason for the caller's warning.
  virtual void* allocate(size_t bytes, std::string* error) = 0;
  virtual void release(void* ptr, size_t bytes) noexcept = 0;
  virtual bool pinned() const = 0;
};

struct Block {
  void* ptr = nullptr;
  size_t size = 0;  // bytes reserved for the block (aligned)
  uint32_t chunk = 0;
  size_t offset = 0;
};

struct ArenaOptions {
  size_t min_chunk = 0;  // set by the caller (the engine's configuration)
  size_t max_chunk = size_t{1} << 30;
  // A new chunk is 1/growth_divisor of what is already reserved (clamped to
  // [min_chunk, max_chunk]) so over-reservation stays near 1/growth_divisor.
  size_t growth_divisor = 16;
  size_t limit = SIZE_MAX;
  size_t alignment = 256;
  // Empty chunks stay until release_empty_chunks() (a small arena of I/O
  // buffers whose chunks cost a registration each to make and give back).
  bool keep_empty_chunks = false;
  // How long the peak of the bytes in use holds empty chunks as spares (0:
  // never beyond the quarter), and the clock it is measured with, in
  // milliseconds (nullptr: std::chrono::steady_clock; tests pass their own).
  uint64_t spare_window_ms = 5000;
  uint64_t (*now_ms)() = nullptr;
};

class Arena {
 public:
  Arena(ChunkSource& source, ArenaOptions options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // nullopt when the budget or the chunk source refuses; `error` says why.
  // Calls the chunk source while the caller holds its lock: the engine uses
  // the three steps below instead, so slow pinning runs unlocked.
  std::optional<Block> allocate(size_t bytes, std::string* error = nullptr);
  // A block from the free space of existing chunks, or nullopt.
  std::optional<Block> allocate_existing(size_t bytes);
  // Reserves budget for the chunk a request of `bytes` needs and returns its
  // size (0: over budget, `error` says why). The chunk is then made by the
  // source without a lock and handed to finish_chunk (nullptr: it failed).
  size_t begin_chunk(size_t bytes, std::string* error);
  void finish_chunk(void* base, size_t size);
  void free(const Block& block);

  void set_limit(size_t limit) { options_.limit = limit; }
  size_t limit() const { return options_.limit; }
  size_t reserved_bytes() const { return reserved_; }
  size_t in_use_bytes() const { return in_use_; }
  size_t chunk_count() const;
  // Size of the next regular chunk; requests above it get a chunk of their own.
  size_t chunk_size() const;
  size_t round_up(size_t bytes) const;
  // Returns every chunk with no live block to the source.
  size_t release_empty_chunks();
  // No new block is placed in any chunk made so far; each goes back to the
  // source once its last block is freed (empty ones: at the next free or
  // release_empty_chunks(); never from here, which may run in a fork handler). (Fork: a disk file
  // both processes map is written by neither after it.)
  void seal_all();

 private:
  struct Chunk {
    char* base = nullptr;
    size_t size = 0;
    size_t used = 0;
    bool live = false;
    bool sealed = false;            // no free range indexed: nothing new goes here
    std::map<size_t, size_t> free;  // offset -> length
  };
  using FreeKey = std::tuple<size_t, uint32_t, size_t>;  // length, chunk, offset

  uint32_t adopt(void* base, size_t bytes);
  uint64_t now_ms() const;
  // The bytes in use grew (allocate_existing): the peak and when it was seen.
  void note_in_use();
  // Whether the spare window since the last peak is over (always, without a window).
  bool window_over() const;
  // The peak of the bytes in use within the spare window (in_use_ once it is over).
  size_t recent_peak() const;
  void drop_chunk(uint32_t index);
  // Empty chunks beyond the spare allowance go back to the source (with `for_peak`, the
  // allowance covers a recent peak of the bytes in use; else a quarter of those in use).
  void trim_spares(bool for_peak = true);
  void insert_free(uint32_t chunk, size_t offset, size_t length);
  void erase_free(uint32_t chunk, size_t offset, size_t length);

  ChunkSource& source_;
  ArenaOptions options_;
  std::vector<Chunk> chunks_;
  std::set<FreeKey> by_length_;  // best-fit index over every chunk's free ranges
  size_t reserved_ = 0;
  size_t pending_ = 0;  // budget held for chunks being made
  size_t in_use_ = 0;
  size_t peak_ = 0;  // the bytes in use at their peak, seen at peak_ms_
  uint64_t peak_ms_ = 0;
  bool spares_past_quarter_ = false;  // trim_spares kept spares for the peak only
};

}  // namespace offcache
