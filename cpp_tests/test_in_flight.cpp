// The in-flight ledger and the deferred frees when an event query throws (a
// sticky CUDA error, or a query refused during another thread's capture):
// nothing retired dies under the owner's lock, nothing is lost or freed twice.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "deferred_free.h"
#include "in_flight.h"

namespace offcache {
namespace {

// An event whose query throws, as cudaEventQuery on a broken context does.
class BrokenEvent final : public Event {
 public:
  bool query() override { throw std::runtime_error("sticky: illegal address"); }
  void wait() override { throw std::runtime_error("sticky: illegal address"); }
  double elapsed_ms_since(Event&) override { return 0.0; }
};

EventPtr done_event() { return HostEvent::completed(); }

// A payload that, like an arena tensor, takes the owner's lock when it dies.
// try_lock: a payload dying under the lock would deadlock the real engine;
// here it is counted instead.
struct LockingPayload {
  std::mutex* mu = nullptr;
  std::atomic<int>* died_unlocked = nullptr;
  std::atomic<int>* died_locked = nullptr;
  LockingPayload() = default;
  LockingPayload(std::mutex* m, std::atomic<int>* u, std::atomic<int>* l)
      : mu(m), died_unlocked(u), died_locked(l) {}
  LockingPayload(LockingPayload&& o) noexcept
      : mu(std::exchange(o.mu, nullptr)),
        died_unlocked(o.died_unlocked),
        died_locked(o.died_locked) {}
  LockingPayload& operator=(LockingPayload&& o) noexcept {
    die();
    mu = std::exchange(o.mu, nullptr);
    died_unlocked = o.died_unlocked;
    died_locked = o.died_locked;
    return *this;
  }
  ~LockingPayload() { die(); }
  void die() {
    if (mu == nullptr) return;
    if (mu->try_lock()) {
      mu->unlock();
      ++*died_unlocked;
    } else {
      ++*died_locked;
    }
    mu = nullptr;
  }
};

using Ledger = InFlightLedger<LockingPayload>;

Ledger::Batch batch(EventPtr done, const void* stream, size_t bytes, std::mutex* mu,
                    std::atomic<int>* unlocked, std::atomic<int>* locked) {
  Ledger::Batch b;
  b.done = std::move(done);
  b.stream = stream;
  b.bytes = bytes;
  b.held = std::make_shared<Held<LockingPayload>>(LockingPayload(mu, unlocked, locked),
                                                  LockingPayload());
  return b;
}

TEST(InFlight, RetiredPayloadsDieAfterTheLockEvenWhenAQueryThrows) {
  std::mutex mu;
  std::atomic<int> unlocked{0}, locked{0};
  Ledger ledger;
  int s = 0;
  ledger.add(batch(done_event(), &s, 10, &mu, &unlocked, &locked));
  ledger.add(batch(std::make_shared<BrokenEvent>(), &s, 20, &mu, &unlocked, &locked));
  try {
    Retiring<LockingPayload> r{std::unique_lock<std::mutex>(mu)};
    ledger.reap([](const EventPtr& e) { return e->query(); }, [](const Ledger::Batch&) {},
                r.sink());
    FAIL() << "the broken query did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "sticky: illegal address");
  }
  EXPECT_EQ(locked.load(), 0);    // nothing died under the lock
  EXPECT_EQ(unlocked.load(), 1);  // the first batch's payload died after it
  // The ledger stays consistent: the unknown batch is still listed, with its bytes.
  EXPECT_EQ(ledger.size(), 1u);
  EXPECT_EQ(ledger.bytes(), 20u);
  EXPECT_EQ(ledger.bounded_bytes(0), 20u);
}

TEST(InFlight, ReapStopsAtEachStreamsFirstBusyBatch) {
  std::mutex mu;
  std::atomic<int> unlocked{0}, locked{0};
  Ledger ledger;
  int a = 0, b = 0;
  auto running = std::make_shared<HostEvent>();
  ledger.add(batch(running, &a, 1, &mu, &unlocked, &locked));
  ledger.add(batch(done_event(), &a, 2, &mu, &unlocked, &locked));  // after `running`: not asked
  ledger.add(batch(done_event(), &b, 4, &mu, &unlocked, &locked));
  int queries = 0;
  {
    Retiring<LockingPayload> r{std::unique_lock<std::mutex>(mu)};
    ledger.reap(
        [&](const EventPtr& e) {
          ++queries;
          return e->query();
        },
        [](const Ledger::Batch&) {}, r.sink());
  }
  EXPECT_EQ(queries, 2);
  EXPECT_EQ(ledger.size(), 2u);
  EXPECT_EQ(ledger.bytes(), 3u);
  EXPECT_EQ(unlocked.load(), 1);
  running->complete();
  {
    Retiring<LockingPayload> r{std::unique_lock<std::mutex>(mu)};
    ledger.reap([](const EventPtr& e) { return e->query(); }, [](const Ledger::Batch&) {},
                r.sink());
  }
  EXPECT_EQ(ledger.size(), 0u);
  EXPECT_EQ(ledger.bytes(), 0u);
  EXPECT_EQ(unlocked.load(), 3);
  EXPECT_EQ(locked.load(), 0);
}

TEST(InFlight, HeldIsTakenOnceByWhoeverSeesItFirst) {
  // A ticket's wait and the ledger's reap race for the same batch's payload.
  std::mutex mu;  // never held here: every payload dies unlocked
  std::atomic<int> unlocked{0}, locked{0};
  for (int round = 0; round < 200; ++round) {
    auto held = std::make_shared<Held<LockingPayload>>(LockingPayload(&mu, &unlocked, &locked),
                                                       LockingPayload(&mu, &unlocked, &locked));
    std::thread ticket([&] {
      std::vector<LockingPayload> taken;
      held->take_queued(&taken);
      held->take_all(&taken);
    });
    std::vector<LockingPayload> taken;
    held->take_all(&taken);
    ticket.join();
  }
  EXPECT_EQ(unlocked.load(), 400);  // each payload died exactly once
  EXPECT_EQ(locked.load(), 0);
}

TEST(DeferredFreesReclaim, AThrowingQueryNeitherLosesNorDoubleFreesBlocks) {
  DeferredFrees pending;
  auto block = [](size_t i) { return Block{reinterpret_cast<void*>(0x1000 * (i + 1)), 64, 0, 0}; };
  auto running = std::make_shared<HostEvent>();
  pending.push(block(0), {done_event()});
  pending.push(block(1), {running});
  pending.push(block(2), {done_event()});
  pending.push(block(3), {done_event()});
  std::vector<void*> released;
  auto release = [&](const Block& b) { released.push_back(b.ptr); };
  int calls = 0;
  auto throw_third = [&](const EventPtr& e) {
    if (++calls == 3) throw std::runtime_error("sticky");
    return e->query();
  };
  EXPECT_THROW(pending.reclaim(throw_third, release), std::runtime_error);
  ASSERT_EQ(released.size(), 1u);  // block 0; block 1 kept; block 2's query threw
  EXPECT_EQ(pending.size(), 3u);
  EXPECT_EQ(pending.bytes(), 3u * 64);
  running->complete();
  EXPECT_EQ(pending.reclaim(release), 3u);
  const std::vector<void*> want{block(0).ptr, block(1).ptr, block(2).ptr, block(3).ptr};
  EXPECT_EQ(released, want);  // each once, oldest first
  EXPECT_EQ(pending.size(), 0u);
}

TEST(DeferredFreesReclaim, AThrowingReleaseKeepsTheBlockPending) {
  DeferredFrees pending;
  pending.push(Block{reinterpret_cast<void*>(0x1000), 64, 0, 0}, {done_event()});
  pending.push(Block{reinterpret_cast<void*>(0x2000), 64, 0, 0}, {done_event()});
  int calls = 0;
  std::vector<void*> released;
  auto flaky = [&](const Block& b) {
    if (++calls == 2) throw std::bad_alloc();
    released.push_back(b.ptr);
  };
  EXPECT_THROW(pending.reclaim(flaky), std::bad_alloc);
  EXPECT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending.reclaim(flaky), 1u);
  EXPECT_EQ(released,
            (std::vector<void*>{reinterpret_cast<void*>(0x1000), reinterpret_cast<void*>(0x2000)}));
}

// A block's fence list pruned while a query throws part-way (HostBlock::add_fence): before, a
// std::remove_if moved kept fences forward and left moved-from (null) entries behind.
TEST(DropCompleted, AThrowingQueryLeavesTheListAsItWas) {
  for (size_t n : {3, 5, 70, 130}) {
    for (size_t throw_at = 0; throw_at < n; ++throw_at) {
      std::vector<EventPtr> events;
      for (size_t i = 0; i < n; ++i) {
        events.push_back(i % 2 == 0 ? done_event() : std::make_shared<HostEvent>());
      }
      const std::vector<EventPtr> before = events;
      size_t asked = 0;
      EXPECT_THROW(drop_completed(&events,
                                  [&](const EventPtr& e) {
                                    if (asked++ == throw_at) throw EventUnknown("refused for now");
                                    return e->query();
                                  }),
                   EventUnknown);
      EXPECT_EQ(events, before) << n << " events, query " << throw_at << " threw";
    }
    std::vector<EventPtr> events;
    for (size_t i = 0; i < n; ++i) {
      events.push_back(i % 2 == 0 ? done_event() : std::make_shared<HostEvent>());
    }
    std::vector<EventPtr> pending;
    for (size_t i = 1; i < n; i += 2) pending.push_back(events[i]);
    drop_completed(&events, [](const EventPtr& e) { return e->query(); });
    EXPECT_EQ(events, pending);  // the completed ones gone, the others in order
  }
}

}  // namespace
}  // namespace offcache
