#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "arena.h"
#include "deferred_free.h"
#include "host_stream.h"

namespace offcache {
namespace {

TEST(HostStream, RunsTasksInOrderAndEventsFollowThem) {
  HostStream s;
  std::vector<int> seen;
  for (int i = 0; i < 100; ++i) s.submit([&seen, i] { seen.push_back(i); });
  auto e = s.record();
  e->wait();
  ASSERT_EQ(seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
}

TEST(HostStream, WaitEventOrdersAcrossStreams) {
  HostStream producer, consumer;
  std::atomic<int> value{0};
  producer.submit([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    value = 42;
  });
  consumer.wait_event(producer.record());
  int observed = -1;
  consumer.submit([&] { observed = value.load(); });
  consumer.synchronize();
  EXPECT_EQ(observed, 42);
}

TEST(HostEvent, ElapsedIsNonNegative) {
  HostStream s;
  auto a = s.record();
  s.submit([] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
  auto b = s.record();
  b->wait();
  EXPECT_GE(b->elapsed_ms_since(*a), 1.5);
}

TEST(HostStream, ManyThreadsSubmitting) {
  HostStream s;
  std::atomic<int> count{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) s.submit([&] { ++count; });
    });
  }
  for (auto& t : threads) t.join();
  s.synchronize();
  EXPECT_EQ(count.load(), 4000);
}

// fork() while tasks are queued: the parent's streams go on; the child, which
// has no worker thread, starts one and runs what it submits.
TEST(HostStream, ForkWhileBusy) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer cannot start threads in a forked child";
#endif
  HostStream s;
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) {
    s.submit([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      ++ran;
    });
  }
  const pid_t pid = fork();
  if (pid == 0) {
    // Everything submitted before fork() ran before it (the stream was drained).
    int ok = ran.load() == 50 ? 0 : 1;
    std::atomic<int> child{0};
    s.submit([&] { child = 7; });
    s.synchronize();
    _exit(ok == 0 && child.load() == 7 ? 0 : 2);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  s.synchronize();
  EXPECT_EQ(ran.load(), 50);
}

// fork() while an I/O stream's task waits for an event of a copy stream made (and
// registered) before it, with work still arriving: the fork handler must not stop the
// copy stream first and leave that task, and so the fork, waiting forever. Run in a
// process of its own, so that a hang fails the test instead of hanging it.
TEST(HostStream, ForkWhileATaskWaitsOnAnotherStreamDoesNotHang) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer cannot start threads in a forked child";
#endif
  const pid_t runner = fork();
  ASSERT_GE(runner, 0);
  if (runner == 0) {
    int code = 0;
    {
      HostStream copies;  // registered first
      HostStream io;
      std::atomic<bool> stop{false};
      std::thread feeder([&] {
        for (int n = 1; !stop.load(); ++n) {
          copies.submit([] { std::this_thread::sleep_for(std::chrono::microseconds(300)); });
          io.wait_event(copies.record());
          io.submit([] {});
          if (n % 8 == 0) io.synchronize();  // a bounded queue
        }
      });
      for (int i = 0; i < 30 && code == 0; ++i) {
        const pid_t pid = fork();
        if (pid == 0) _exit(0);
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) code = 1;
      }
      stop = true;
      feeder.join();
    }
    _exit(code);
  }
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 1200 && done == 0; ++i) {  // a hang guard: 2 minutes for 30 forks
    done = waitpid(runner, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (done == 0) {
    kill(runner, SIGKILL);
    waitpid(runner, &status, 0);
    FAIL() << "fork() hung while a task waited for another stream's event";
  }
  ASSERT_EQ(done, runner);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

class MallocSource : public ChunkSource {
 public:
  void* allocate(size_t bytes, std::string*) override { return std::malloc(bytes); }
  void release(void* p, size_t) noexcept override { std::free(p); }
  bool pinned() const override { return false; }
};

// A block is reused only after every copy that touches it has completed.
TEST(DeferredFrees, BlockReusedOnlyAfterFences) {
  MallocSource src;
  ArenaOptions o;
  o.min_chunk = o.max_chunk = 4096;
  Arena arena(src, o);
  HostStream copy;
  auto b = *arena.allocate(4096);
  std::atomic<bool> release_copy{false};
  copy.submit([&] {
    while (!release_copy) std::this_thread::yield();
    std::memset(b.ptr, 7, 4096);  // a slow copy still writing the block
  });
  DeferredFrees pending;
  pending.push(b, {copy.record()});
  auto release = [&](const Block& blk) { arena.free(blk); };
  EXPECT_EQ(pending.reclaim(release), 0u);
  EXPECT_EQ(arena.in_use_bytes(), 4096u);
  release_copy = true;
  pending.wait_all();
  EXPECT_EQ(pending.reclaim(release), 1u);
  EXPECT_EQ(arena.in_use_bytes(), 0u);
  EXPECT_EQ(pending.size(), 0u);
}

// A stream-written store may take a pending block before its fences complete,
// with the fences to order its copy after: the smallest that fits, never one
// that does not, and the list keeps the rest in order.
TEST(DeferredFrees, TakeFittingHandsOverTheBlockWithItsFences) {
  DeferredFrees pending;
  auto slow = std::make_shared<HostEvent>();
  auto other = std::make_shared<HostEvent>();
  pending.push(Block{nullptr, 8192, 0, 0}, {slow});
  pending.push(Block{nullptr, 4096, 1, 0}, {other, slow});
  pending.push(Block{nullptr, 1024, 2, 0}, {});
  auto none = pending.take_fitting([](const Block& b) { return b.size >= 16384; });
  EXPECT_FALSE(none.has_value());
  EXPECT_EQ(pending.size(), 3u);
  auto t = pending.take_fitting([](const Block& b) { return b.size >= 2048; });
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->block.chunk, 1u);  // 4096: the smallest that fits, not the first
  ASSERT_EQ(t->fences.size(), 2u);
  EXPECT_EQ(t->fences[0], EventPtr(other));
  EXPECT_EQ(pending.size(), 2u);
  EXPECT_EQ(pending.bytes(), 8192u + 1024u);
  // The rest stay pending on their own fences: the 1024 block is free now, the 8192 one is not.
  size_t freed = pending.reclaim([](const Block& b) { EXPECT_EQ(b.chunk, 2u); });
  EXPECT_EQ(freed, 1u);
  slow->complete();
  EXPECT_EQ(pending.reclaim([](const Block& b) { EXPECT_EQ(b.chunk, 0u); }), 1u);
  EXPECT_EQ(pending.size(), 0u);
}

// A failing task (a CUDA event wait that throws on a sticky error, say) must
// not end the process: later tasks are skipped, later events complete, and
// the error is kept for the engine to raise.
TEST(HostStream, ThrowingTaskIsReportedNotFatal) {
  HostStream s;
  std::atomic<int> ran{0};
  s.submit([] { throw std::runtime_error("cudaEventSynchronize failed: sticky"); });
  s.submit([&] { ++ran; });
  auto e = s.record();
  e->wait();
  EXPECT_TRUE(e->query());
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(s.error(), "cudaEventSynchronize failed: sticky");
  s.synchronize();                                              // still completes
  EXPECT_EQ(s.error(), "cudaEventSynchronize failed: sticky");  // sticky
}

class ThrowingEvent final : public Event {
 public:
  bool query() override { return false; }
  void wait() override { throw std::runtime_error("event wait failed"); }
  double elapsed_ms_since(Event&) override { return 0; }
};

TEST(HostStream, WaitOnAFailingEventCompletesLaterEvents) {
  HostStream s;
  s.wait_event(std::make_shared<ThrowingEvent>());
  auto e = s.record();
  e->wait();
  EXPECT_EQ(s.error(), "event wait failed");
}

// The owner's per-thread preparation (a CUDA device selection, say) runs on the
// worker before every task, wait_event's waits included, and never on another thread.
TEST(HostStream, PrepareRunsOnTheWorkerBeforeEachTask) {
  thread_local bool prepared = false;
  std::atomic<int> calls{0};
  std::atomic<int> unprepared{0};
  HostStream producer;
  HostStream s([&] {
    prepared = true;
    ++calls;
  });
  auto check = [&] {
    if (!prepared) ++unprepared;
  };
  s.submit(check);
  producer.submit([] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); });
  s.wait_event(producer.record());
  s.submit(check);
  s.synchronize();
  EXPECT_FALSE(prepared);  // this thread was never prepared
  EXPECT_EQ(unprepared.load(), 0);
  EXPECT_GE(calls.load(), 2);
}

// A preparation that throws fails its task like the task's own error would:
// sticky, and later events still complete.
TEST(HostStream, PrepareThatThrowsFailsTheTaskNotTheEvents) {
  std::atomic<int> ran{0};
  HostStream s([] { throw std::runtime_error("cudaSetDevice failed"); });
  s.submit([&] { ++ran; });
  auto e = s.record();
  e->wait();
  EXPECT_EQ(ran.load(), 0);
  EXPECT_EQ(s.error(), "cudaSetDevice failed");
}

// Copies issued by the I/O thread once their reads are done: the chained event
// follows them, and says so when they were never issued.
TEST(ChainedEvent, CompletesAfterTheWorkItsIssuerHandsOver) {
  HostStream io, copies;
  std::atomic<bool> gate{false};
  std::atomic<int> copied{0};
  auto chained = std::make_shared<ChainedEvent>();
  io.submit([&] {
    while (!gate.load()) std::this_thread::yield();  // a slow read
    copies.submit([&] { ++copied; });
    chained->set(copies.record());
    chained->finish();
  });
  chained->issued_by(io.record());
  EXPECT_FALSE(chained->query());
  EXPECT_FALSE(chained->issued());
  gate = true;
  chained->wait();
  EXPECT_TRUE(chained->query());
  EXPECT_EQ(copied.load(), 1);
}

TEST(ChainedEvent, WaitRaisesTheReasonWhenNotAllWasIssued) {
  HostStream io, copies;
  std::atomic<bool> gate{false};
  std::atomic<int> copied{0};
  auto chained = std::make_shared<ChainedEvent>();
  io.submit([&, chained] {  // the first piece: its copy is issued, and slow
    copies.submit([&] {
      while (!gate.load()) std::this_thread::yield();
      ++copied;
    });
    chained->set(copies.record());
  });
  io.submit([chained] {
    chained->fail("reading /x: unexpected end of file");
    throw std::runtime_error("reading /x: unexpected end of file");
  });
  io.submit([chained] { chained->finish(); });  // skipped: the stream failed
  chained->issued_by(io.record());
  io.synchronize();
  EXPECT_TRUE(chained->issued());
  EXPECT_FALSE(chained->query());  // the copy issued before the failure still runs
  gate = true;
  chained->wait();  // the engine's own waits return, after that copy
  EXPECT_EQ(copied.load(), 1);
  EXPECT_TRUE(chained->query());
  try {
    chained->wait_current(-1);
    FAIL() << "wait_current() returned for copies that were not all issued";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected end of file"), std::string::npos) << e.what();
  }
  // A later chain on the failed stream is skipped whole: it completes, and raises.
  auto later = std::make_shared<ChainedEvent>();
  io.submit([later] { later->finish(); });
  later->issued_by(io.record());
  later->wait();
  EXPECT_THROW(later->wait_current(-1), std::runtime_error);
}

}  // namespace
}  // namespace offcache
