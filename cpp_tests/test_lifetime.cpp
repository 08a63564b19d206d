#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "lifetime.h"

namespace offcache {
namespace {

// Stands in for an engine: counts its deletions (ASan and TSan see the rest).
struct Retiree {
  Lifetime life;
  std::atomic<int>* deleted;
  Lifetime& lifetime() { return life; }
  ~Retiree() { ++*deleted; }
};

void maybe_delete(RetiredSet<Retiree>& set, Retiree* r) {
  if (Retiree* t = set.take_if_idle(r)) delete t;
}

TEST(Lifetime, RetiredObjectGoesWithItsLastBlock) {
  std::atomic<int> deleted{0};
  RetiredSet<Retiree> set;
  auto* r = new Retiree{{}, &deleted};
  r->life.add_block();
  EXPECT_FALSE(set.retire(r));  // a block still lives: listed
  EXPECT_EQ(set.size(), 1u);
  if (r->life.release_block()) maybe_delete(set, r);
  EXPECT_EQ(deleted.load(), 1);
  EXPECT_EQ(set.size(), 0u);
}

TEST(Lifetime, IdleObjectIsDeletedAtRetirement) {
  std::atomic<int> deleted{0};
  RetiredSet<Retiree> set;
  auto* r = new Retiree{{}, &deleted};
  EXPECT_TRUE(set.retire(r));
  delete r;
  EXPECT_EQ(set.size(), 0u);
}

TEST(Lifetime, EnteredObjectIsNotTakenUntilItsUserLeaves) {
  std::atomic<int> deleted{0};
  RetiredSet<Retiree> set;
  auto* r = new Retiree{{}, &deleted};
  r->life.add_block();
  set.retire(r);
  auto entered = set.enter_all();
  ASSERT_EQ(entered.size(), 1u);
  EXPECT_TRUE(r->life.release_block() == false);  // entered: not idle
  maybe_delete(set, r);                           // a stale report changes nothing
  EXPECT_EQ(deleted.load(), 0);
  if (r->life.leave()) maybe_delete(set, r);
  EXPECT_EQ(deleted.load(), 1);
}

// The race the engine had: one thread enters every retired object (synchronize)
// while another retires objects and drops their last block. Each object must be
// deleted exactly once, never while entered (run under ASan and TSan).
TEST(Lifetime, ConcurrentEnterAndLastReleaseDeleteOnce) {
  std::atomic<int> deleted{0};
  std::atomic<bool> stop{false};
  RetiredSet<Retiree> set;
  std::thread synchronizer([&] {
    while (!stop.load()) {
      for (Retiree* r : set.enter_all()) {
        r->life.idle();  // uses it while entered
        if (r->life.leave()) maybe_delete(set, r);
      }
    }
  });
  constexpr int kObjects = 2000;
  for (int i = 0; i < kObjects; ++i) {
    auto* r = new Retiree{{}, &deleted};
    r->life.add_block();
    if (set.retire(r)) {
      delete r;
      continue;
    }
    if (r->life.release_block()) maybe_delete(set, r);
  }
  stop = true;
  synchronizer.join();
  for (Retiree* r : set.enter_all()) {  // what the synchronizer still held when it stopped
    if (r->life.leave()) maybe_delete(set, r);
  }
  EXPECT_EQ(deleted.load(), kObjects);
  EXPECT_EQ(set.size(), 0u);
}

}  // namespace
}  // namespace offcache
