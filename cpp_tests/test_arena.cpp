#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#include "arena.h"

namespace offcache {
namespace {

// Counts chunks and can be told to refuse, like cudaHostAlloc under a
// memlock limit.
class CountingSource : public ChunkSource {
 public:
  void* allocate(size_t bytes, std::string* error) override {
    if (refuse) {
      if (error) *error = "refused";
      return nullptr;
    }
    ++live;
    return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);  // like mmap
  }
  void release(void* ptr, size_t) noexcept override {
    --live;
    std::free(ptr);
  }
  bool pinned() const override { return false; }
  int live = 0;
  bool refuse = false;
};

// The quarter-of-in-use spares alone (no window for a recent peak), unless a test sets one.
ArenaOptions fixed(size_t chunk, size_t limit = SIZE_MAX) {
  ArenaOptions o;
  o.min_chunk = o.max_chunk = chunk;
  o.limit = limit;
  o.alignment = 256;
  o.spare_window_ms = 0;
  return o;
}

uint64_t g_now_ms = 0;  // the clock of the spare-window tests
ArenaOptions windowed(size_t chunk, size_t limit = SIZE_MAX) {
  ArenaOptions o = fixed(chunk, limit);
  o.spare_window_ms = 1000;
  o.now_ms = [] { return g_now_ms; };
  return o;
}

TEST(Arena, ExactSizeNoPowerOfTwoRounding) {
  CountingSource src;
  Arena arena(src, fixed(1 << 20));
  auto b = arena.allocate(257 * 1024 + 1);  // just over 257 KiB
  ASSERT_TRUE(b);
  EXPECT_EQ(b->size, 257 * 1024 + 256);
  EXPECT_EQ(arena.in_use_bytes(), 257 * 1024 + 256);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->ptr) % 256, 0u);
}

TEST(Arena, BlocksDoNotOverlap) {
  CountingSource src;
  Arena arena(src, fixed(1 << 20));
  std::vector<Block> blocks;
  for (int i = 0; i < 100; ++i) {
    auto b = arena.allocate(1000 + i * 37);
    ASSERT_TRUE(b);
    std::memset(b->ptr, i, b->size);
    blocks.push_back(*b);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto* p = static_cast<unsigned char*>(blocks[i].ptr);
    for (size_t k = 0; k < blocks[i].size; ++k) ASSERT_EQ(p[k], i);
  }
}

TEST(Arena, CoalescesFreeNeighbours) {
  CountingSource src;
  Arena arena(src, fixed(4096));
  auto a = arena.allocate(1024), b = arena.allocate(1024), c = arena.allocate(1024),
       d = arena.allocate(1024);
  ASSERT_TRUE(a && b && c && d);
  EXPECT_EQ(arena.chunk_count(), 1u);
  arena.free(*b);
  arena.free(*c);  // b+c merge into 2 KiB
  auto big = arena.allocate(2048);
  ASSERT_TRUE(big);
  EXPECT_EQ(big->ptr, b->ptr);
  EXPECT_EQ(arena.chunk_count(), 1u);
  arena.free(*a);
  arena.free(*big);
  arena.free(*d);  // whole chunk free again, merged into one range
  auto whole = arena.allocate(4096);
  ASSERT_TRUE(whole);
  EXPECT_EQ(whole->ptr, a->ptr);
}

TEST(Arena, OversizedRequestGetsDedicatedChunkKeptAsTheSpare) {
  CountingSource src;
  Arena arena(src, fixed(1 << 16));
  auto small = arena.allocate(100);
  auto big = arena.allocate(1 << 20);
  ASSERT_TRUE(small && big);
  EXPECT_EQ(src.live, 2);
  EXPECT_EQ(arena.reserved_bytes(), (1u << 16) + (1u << 20));
  arena.free(*big);  // the only empty chunk: kept, and reused by the next large request
  EXPECT_EQ(src.live, 2);
  auto again = arena.allocate(1 << 20);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->ptr, big->ptr);
  EXPECT_EQ(src.live, 2);
  arena.free(*again);
  arena.free(*small);  // two empty chunks: the smaller goes back
  EXPECT_EQ(src.live, 1);
  EXPECT_EQ(arena.reserved_bytes(), 1u << 20);
}

TEST(Arena, BudgetRefusesThenSmallerChunkFits) {
  CountingSource src;
  Arena arena(src, fixed(1 << 20, (1 << 20) + 8192));
  auto a = arena.allocate(1 << 20);  // fills the first chunk exactly
  ASSERT_TRUE(a);
  auto b = arena.allocate(4096);  // a full chunk would exceed the limit; a small one fits
  ASSERT_TRUE(b);
  std::string why;
  auto c = arena.allocate(1 << 16, &why);
  EXPECT_FALSE(c);
  EXPECT_NE(why.find("budget"), std::string::npos);
  EXPECT_LE(arena.reserved_bytes(), arena.limit());
}

TEST(Arena, SourceRefusalIsReportedNotThrown) {
  CountingSource src;
  src.refuse = true;
  Arena arena(src, fixed(1 << 20));
  std::string why;
  EXPECT_FALSE(arena.allocate(10, &why));
  EXPECT_EQ(why, "refused");
  EXPECT_EQ(arena.reserved_bytes(), 0u);
}

TEST(Arena, KeepsOnlyOneEmptySpareChunk) {
  CountingSource src;
  Arena arena(src, fixed(4096));
  std::vector<Block> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(*arena.allocate(4096));
  EXPECT_EQ(src.live, 4);
  for (auto& b : blocks) arena.free(b);
  EXPECT_EQ(src.live, 1);
  EXPECT_EQ(arena.release_empty_chunks(), 4096u);
  EXPECT_EQ(src.live, 0);
}

// The disk tier's I/O buffers: every chunk made stays until release_empty_chunks(), so a
// working set of several chunks is not registered and unregistered on every cycle.
TEST(Arena, KeepEmptyChunksKeepsEveryChunkUntilReleased) {
  CountingSource src;
  ArenaOptions o = fixed(4096);
  o.keep_empty_chunks = true;
  Arena arena(src, o);
  for (int round = 0; round < 3; ++round) {
    std::vector<Block> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(*arena.allocate(4096));
    for (auto& b : blocks) arena.free(b);
    EXPECT_EQ(src.live, 4);
    EXPECT_EQ(arena.reserved_bytes(), 4u * 4096);
  }
  EXPECT_EQ(arena.release_empty_chunks(), 4u * 4096);
  EXPECT_EQ(src.live, 0);
}

TEST(Arena, GrowthKeepsOverReservationSmall) {
  CountingSource src;
  ArenaOptions o;
  o.min_chunk = 1 << 20;
  o.max_chunk = 1 << 30;
  o.growth_divisor = 16;
  Arena arena(src, o);
  size_t live = 0;
  for (int i = 0; i < 2000; ++i) {
    ASSERT_TRUE(arena.allocate(300 * 1024));
    live += 300 * 1024;
  }
  EXPECT_LE(static_cast<double>(arena.reserved_bytes()) / live, 1.1);
}

TEST(Arena, WorkingSetThatShrinksAndGrowsReusesItsChunks) {
  CountingSource src;
  Arena arena(src, fixed(1 << 16));
  std::vector<Block> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(*arena.allocate(1 << 16));  // 16 full chunks
  EXPECT_EQ(src.live, 16);
  for (int i = 13; i < 16; ++i) arena.free(blocks[i]);  // part of the set goes (3 <= 13 / 4)...
  EXPECT_EQ(src.live, 16);                              // ...and its chunks stay as spares
  for (int i = 13; i < 16; ++i) blocks[i] = *arena.allocate(1 << 16);  // ...and comes back
  EXPECT_EQ(src.live, 16);
  for (auto& b : blocks) arena.free(b);
  EXPECT_EQ(src.live, 1);  // nothing in use: only the largest spare stays
}

// Stores whose results die while their copies are in flight: each needs a block while the last
// one's is still held, so a burst makes chunks that empty right after. They stay for the window,
// and the next burst reuses them instead of making (pinning) them again.
TEST(Arena, SparesHeldForARecentBurstThenReleased) {
  CountingSource src;
  g_now_ms = 10'000;
  Arena arena(src, windowed(4096));
  auto base = arena.allocate(4096);
  ASSERT_TRUE(base);
  for (int round = 0; round < 3; ++round) {
    std::vector<Block> burst;
    for (int i = 0; i < 8; ++i) burst.push_back(*arena.allocate(4096));
    EXPECT_EQ(src.live, 9) << "round " << round << " made chunks again";
    for (auto& b : burst) arena.free(b);
    EXPECT_EQ(src.live, 9);  // the burst's chunks stay as spares within the window
    g_now_ms += 100;
  }
  g_now_ms += 2000;  // the window is over: the next allocation gives the extra spares back
  auto one = arena.allocate(4096);
  ASSERT_TRUE(one);
  EXPECT_EQ(src.live, 3);  // two in use, the largest spare
  arena.free(*one);
  arena.free(*base);
  EXPECT_EQ(src.live, 2);  // the peak since, two chunks, still within its window
  EXPECT_EQ(arena.release_empty_chunks(), 2u * 4096);
  EXPECT_EQ(src.live, 0);
}

TEST(Arena, ARequestNoSpareFitsKeepsTheSparesWithinTheBudget) {
  CountingSource src;
  g_now_ms = 70'000;
  Arena arena(src, windowed(4096));
  std::vector<Block> burst;
  for (int i = 0; i < 4; ++i) burst.push_back(*arena.allocate(4096));
  for (auto& b : burst) arena.free(b);
  EXPECT_EQ(src.live, 4);
  auto big = arena.allocate(2 * 4096);  // a chunk of its own; the burst's spares stay for the next
  ASSERT_TRUE(big);
  EXPECT_EQ(src.live, 5);
  for (int i = 0; i < 4; ++i) burst[i] = *arena.allocate(4096);
  EXPECT_EQ(src.live, 5);
  for (auto& b : burst) arena.free(b);
  arena.free(*big);
}

TEST(Arena, SparesForARecentPeakGiveWayToTheBudget) {
  CountingSource src;
  g_now_ms = 50'000;
  Arena arena(src, windowed(4096, 10 * 4096));
  auto base = arena.allocate(4096);
  std::vector<Block> burst;
  for (int i = 0; i < 8; ++i) burst.push_back(*arena.allocate(4096));
  for (auto& b : burst) arena.free(b);
  EXPECT_EQ(src.live, 9);
  auto big = arena.allocate(3 * 4096);  // no spare fits, and the budget has no room: they go
  ASSERT_TRUE(big);
  EXPECT_EQ(src.live, 3);  // base, the largest spare, the new chunk
  EXPECT_LE(arena.reserved_bytes(), arena.limit());
  arena.free(*big);
  arena.free(*base);
}

TEST(Arena, ChunkMadeOutsideTheLockHoldsItsBudget) {
  CountingSource src;
  Arena arena(src, fixed(1 << 16, 3 << 16));
  std::string why;
  const size_t a = arena.begin_chunk(100, &why);  // two threads plan chunks at once
  const size_t b = arena.begin_chunk(100, &why);
  EXPECT_EQ(a, 1u << 16);
  EXPECT_EQ(b, 1u << 16);
  EXPECT_EQ(arena.begin_chunk(1 << 17, &why), 0u);  // the third would pass the budget
  EXPECT_NE(why.find("budget"), std::string::npos);
  arena.finish_chunk(src.allocate(a, nullptr), a);
  arena.finish_chunk(nullptr, b);  // the source refused: its budget is free again
  EXPECT_EQ(arena.reserved_bytes(), 1u << 16);
  EXPECT_EQ(arena.begin_chunk(1 << 17, &why), 1u << 17);
  arena.finish_chunk(nullptr, 1 << 17);
  auto block = arena.allocate_existing(100);
  ASSERT_TRUE(block);
  EXPECT_EQ(block->chunk, 0u);
}

// Random alloc/free against a model: live blocks never overlap, accounting
// matches, and freeing everything returns all bytes.
TEST(Arena, RandomisedAgainstModel) {
  CountingSource src;
  Arena arena(src, fixed(1 << 16, 1 << 20));
  std::mt19937 rng(1234);
  std::vector<Block> live;
  size_t model_in_use = 0;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      size_t n = 1 + rng() % (rng() % 10 == 0 ? (1 << 17) : 5000);
      auto b = arena.allocate(n);
      if (!b) continue;  // over budget: fine, the engine spills
      ASSERT_GE(b->size, n);
      live.push_back(*b);
      model_in_use += b->size;
    } else {
      size_t i = rng() % live.size();
      arena.free(live[i]);
      model_in_use -= live[i].size;
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(arena.in_use_bytes(), model_in_use);
    ASSERT_LE(arena.reserved_bytes(), arena.limit());
  }
  std::set<std::pair<uintptr_t, uintptr_t>> ranges;
  for (auto& b : live) {
    auto lo = reinterpret_cast<uintptr_t>(b.ptr);
    ranges.emplace(lo, lo + b.size);
  }
  uintptr_t end = 0;
  for (auto& r : ranges) {
    ASSERT_GE(r.first, end);
    end = r.second;
  }
  for (auto& b : live) arena.free(b);
  EXPECT_EQ(arena.in_use_bytes(), 0u);
  arena.release_empty_chunks();
  EXPECT_EQ(src.live, 0);
}

// After fork both processes map the same disk files: neither may place a new
// block in them, and each gives a chunk back once its own last block is freed.
TEST(Arena, SealedChunksTakeNoNewBlocksAndGoWhenEmpty) {
  CountingSource src;
  Arena arena(src, fixed(1 << 20));
  auto a = arena.allocate(1000);
  auto b = arena.allocate(1000);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(src.live, 1);
  arena.seal_all();
  auto c = arena.allocate(1000);  // not in the sealed chunk's free space
  ASSERT_TRUE(c);
  EXPECT_NE(c->chunk, a->chunk);
  EXPECT_EQ(src.live, 2);
  arena.free(*a);
  auto d = arena.allocate(1000);  // a's space is not reused either
  ASSERT_TRUE(d);
  EXPECT_NE(d->ptr, a->ptr);
  EXPECT_EQ(d->chunk, c->chunk);
  arena.free(*b);  // the sealed chunk's last block: the chunk goes back
  EXPECT_EQ(src.live, 1);
  EXPECT_EQ(arena.in_use_bytes(), c->size + d->size);
  arena.free(*c);
  arena.free(*d);
}

}  // namespace
}  // namespace offcache
