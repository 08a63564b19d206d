#include "arena.h"

#include <algorithm>
#include <cassert>
#include <chrono>

namespace offcache {

Arena::Arena(ChunkSource& source, ArenaOptions options) : source_(source), options_(options) {
  assert(options_.alignment > 0 && (options_.alignment & (options_.alignment - 1)) == 0);
  assert(options_.min_chunk > 0 && options_.min_chunk <= options_.max_chunk);
}

Arena::~Arena() {
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i].live) source_.release(chunks_[i].base, chunks_[i].size);
  }
}

uint64_t Arena::now_ms() const {
  if (options_.now_ms != nullptr) return options_.now_ms();
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

bool Arena::window_over() const {
  return options_.spare_window_ms == 0 || now_ms() - peak_ms_ > options_.spare_window_ms;
}

void Arena::note_in_use() {
  if (options_.spare_window_ms == 0) return;
  if (in_use_ >= peak_ || window_over()) {
    peak_ = in_use_;
    peak_ms_ = now_ms();
  }
}

size_t Arena::recent_peak() const { return window_over() ? in_use_ : std::max(peak_, in_use_); }

size_t Arena::round_up(size_t bytes) const {
  size_t a = options_.alignment;
  return (std::max<size_t>(bytes, 1) + a - 1) / a * a;
}

size_t Arena::chunk_size() const {
  size_t grow = reserved_ / std::max<size_t>(options_.growth_divisor, 1);
  size_t size = std::clamp(grow, options_.min_chunk, options_.max_chunk);
  constexpr size_t kGranule = size_t{2} << 20;  // whole huge pages
  return size < kGranule ? round_up(size) : (size + kGranule - 1) / kGranule * kGranule;
}

size_t Arena::chunk_count() const {
  return std::count_if(chunks_.begin(), chunks_.end(), [](const Chunk& c) { return c.live; });
}

uint32_t Arena::adopt(void* base, size_t bytes) {
  uint32_t index = 0;
  while (index < chunks_.size() && chunks_[index].live) ++index;
  if (index == chunks_.size()) chunks_.emplace_back();
  Chunk& c = chunks_[index];
  c = Chunk{};
  c.base = static_cast<char*>(base);
  c.size = bytes;
  c.live = true;
  reserved_ += bytes;
  insert_free(index, 0, bytes);
  return index;
}

void Arena::drop_chunk(uint32_t index) {
  Chunk& c = chunks_[index];
  assert(c.live && c.used == 0);
  if (!c.sealed) erase_free(index, 0, c.size);
  source_.release(c.base, c.size);
  reserved_ -= c.size;
  c = Chunk{};
}

void Arena::insert_free(uint32_t chunk, size_t offset, size_t length) {
  chunks_[chunk].free.emplace(offset, length);
  by_length_.emplace(length, chunk, offset);
}

void Arena::erase_free(uint32_t chunk, size_t offset, size_t length) {
  chunks_[chunk].free.erase(offset);
  by_length_.erase(FreeKey{length, chunk, offset});
}

std::optional<Block> Arena::allocate_existing(size_t bytes) {
  const size_t need = round_up(bytes);
  auto it = by_length_.lower_bound(FreeKey{need, 0, 0});
  if (it == by_length_.end()) return std::nullopt;
  auto [length, chunk, offset] = *it;
  erase_free(chunk, offset, length);
  if (length > need) insert_free(chunk, offset + need, length - need);
  Chunk& c = chunks_[chunk];
  c.used += need;
  // Spares held for a peak whose window is over go back (not the chunk just used: not empty).
  const bool peak_over = spares_past_quarter_ && window_over();
  in_use_ += need;
  note_in_use();
  if (peak_over) trim_spares(/*for_peak=*/false);
  return Block{c.base + offset, need, chunk, offset};
}

size_t Arena::begin_chunk(size_t bytes, std::string* error) {
  const size_t need = round_up(bytes);
  // Oversized requests get a chunk of their own.
  size_t size = std::max(need, chunk_size());
  size_t held = reserved_ + pending_;
  if ((held + size > options_.limit || held + size < held) && spares_past_quarter_) {
    // Spares kept for a recent peak never cost the budget a chunk it needs.
    trim_spares(/*for_peak=*/false);
    held = reserved_ + pending_;
  }
  if (held + size > options_.limit || held + size < held) {
    // Near the budget, a smaller chunk that still fits the request beats spilling.
    const size_t room = options_.limit > held
                            ? (options_.limit - held) / options_.alignment * options_.alignment
                            : 0;
    if (room < need) {
      if (error) *error = "pinned budget of " + std::to_string(options_.limit) + " bytes reached";
      return 0;
    }
    size = std::max(need, std::min(size, room));
  }
  pending_ += size;
  return size;
}

void Arena::finish_chunk(void* base, size_t size) {
  assert(pending_ >= size);
  pending_ -= size;
  if (base != nullptr) adopt(base, size);
}

std::optional<Block> Arena::allocate(size_t bytes, std::string* error) {
  if (auto b = allocate_existing(bytes)) return b;
  const size_t size = begin_chunk(bytes, error);
  if (size == 0) return std::nullopt;
  void* base = source_.allocate(size, error);
  finish_chunk(base, size);
  if (base == nullptr) return std::nullopt;
  return allocate_existing(bytes);
}

void Arena::free(const Block& block) {
  assert(block.chunk < chunks_.size() && chunks_[block.chunk].live);
  Chunk& c = chunks_[block.chunk];
  assert(c.base + block.offset == block.ptr && c.used >= block.size);
  c.used -= block.size;
  in_use_ -= block.size;
  if (c.sealed) {
    if (c.used == 0) drop_chunk(block.chunk);
    return;
  }
  size_t offset = block.offset;
  size_t length = block.size;
  // Coalesce with the free ranges on either side.
  auto next = c.free.lower_bound(offset);
  if (next != c.free.end() && next->first == offset + length) {
    size_t next_len = next->second;
    erase_free(block.chunk, next->first, next_len);
    length += next_len;
  }
  auto after = c.free.lower_bound(offset);
  if (after != c.free.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      size_t prev_off = prev->first, prev_len = prev->second;
      erase_free(block.chunk, prev_off, prev_len);
      offset = prev_off;
      length += prev_len;
    }
  }
  insert_free(block.chunk, offset, length);
  if (c.used == 0) trim_spares();
}

void Arena::trim_spares(bool for_peak) {
  // Spares: empty chunks up to a quarter of the bytes in use, and at least the
  // largest empty one (a free-then-allocate cycle reuses pinned pages). The
  // smallest go back first.
  std::vector<uint32_t> empty;
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    if (!chunks_[i].live || chunks_[i].used != 0) continue;
    if (chunks_[i].sealed) {
      drop_chunk(i);  // never a spare: nothing may be placed in it
    } else {
      empty.push_back(i);
    }
  }
  if (options_.keep_empty_chunks) return;
  std::sort(empty.begin(), empty.end(),
            [this](uint32_t a, uint32_t b) { return chunks_[a].size > chunks_[b].size; });
  // A recent burst's peak holds as many as it used (the bytes in use then, beyond now's).
  const size_t quarter = in_use_ / 4;
  const size_t allowance = for_peak ? std::max(quarter, recent_peak() - in_use_) : quarter;
  size_t kept = 0;
  spares_past_quarter_ = false;
  for (size_t k = 0; k < empty.size(); ++k) {
    const size_t size = chunks_[empty[k]].size;
    if (k == 0 || kept + size <= allowance) {
      kept += size;
      if (k > 0 && kept > quarter) spares_past_quarter_ = true;
    } else {
      drop_chunk(empty[k]);
    }
  }
}

void Arena::seal_all() {
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    // Nothing goes back to the source here (a fork handler: the source's
    // lock may be held by a thread that is gone); empty ones go with the next
    // free or release_empty_chunks().
    if (!c.live || c.sealed) continue;
    for (const auto& [offset, length] : c.free) by_length_.erase(FreeKey{length, i, offset});
    c.free.clear();
    c.sealed = true;
  }
}

size_t Arena::release_empty_chunks() {
  size_t released = 0;
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i].live && chunks_[i].used == 0) {
      released += chunks_[i].size;
      drop_chunk(i);
    }
  }
  return released;
}

}  // namespace offcache
