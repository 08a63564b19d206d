// Completion events shared by both backends. A CUDA event and a host
// completion flag expose the same interface so the engine's scheduling code
// (fences, deferred frees, in-flight accounting) is identical on both.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace offcache {

// Thrown by Event::query when the event's state cannot be known now but
// nothing is broken (a CUDA graph capture on another thread forbids the
// query): ask again later. Any other exception from a query means the event
// will never be known (a sticky CUDA error: the context is broken).
struct EventUnknown : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Event {
 public:
  virtual ~Event() = default;
  // True once every operation recorded before the event has finished.
  virtual bool query() = 0;
  // Blocks the calling host thread until query() is true.
  virtual void wait() = 0;
  // Makes the current stream of GPU `device` wait for the event (device < 0:
  // the calling thread, which blocks). A host event always blocks.
  virtual void wait_current(int /*device*/) { wait(); }
  // Milliseconds between `start` and this event; both must be complete.
  virtual double elapsed_ms_since(Event& start) = 0;
};

using EventPtr = std::shared_ptr<Event>;

// Drops from `events` those `query` reports complete, keeping the others in
// order. Every query runs before anything moves: when one throws, `events` is
// left exactly as it was (no event dropped, none moved from) and the exception
// propagates. (std::remove_if would leave moved-from, empty entries behind.)
template <class Query>
void drop_completed(std::vector<EventPtr>* events, Query&& query) {
  std::vector<EventPtr>& v = *events;
  uint64_t done = 0;        // the first 64 events' answers
  std::vector<char> later;  // any beyond (rare): one flag each
  if (v.size() > 64) later.resize(v.size() - 64);
  for (size_t i = 0; i < v.size(); ++i) {
    if (!query(v[i])) continue;
    if (i < 64) {
      done |= uint64_t{1} << i;
    } else {
      later[i - 64] = 1;
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i < 64 ? (done >> i) & 1 : later[i - 64]) continue;
    if (kept != i) v[kept] = std::move(v[i]);
    ++kept;
  }
  v.resize(kept);
}

// A one-shot completion flag set by a host worker thread ("stream").
class HostEvent final : public Event {
 public:
  HostEvent() = default;
  // An event that is already complete (work done synchronously by the caller).
  static std::shared_ptr<HostEvent> completed();

  void complete();
  bool query() override { return done_.load(std::memory_order_acquire); }
  void wait() override;
  double elapsed_ms_since(Event& start) override;
  std::chrono::steady_clock::time_point when() const { return when_; }

 private:
  std::atomic<bool> done_{false};
  std::chrono::steady_clock::time_point when_{};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Work that a host thread (the engine's I/O thread) issues onto a stream only
// once its inputs are ready, in several tasks: each hands over the stream's
// event after its work with set(), the last also calls finish(). `issued`
// completes when the thread has run, or skipped after a failure, every task.
// Complete once `issued` and the last handed-over event are, so work issued
// before a failure still finishes first. wait() only blocks (the engine's own
// waits); wait_current(), the consumer's wait, raises unless every task ran,
// so nobody reads outputs that were not written.
class ChainedEvent final : public Event {
 public:
  // Before the event is shared: the host event recorded after the issuing tasks.
  void issued_by(std::shared_ptr<HostEvent> issued) { issued_ = std::move(issued); }
  // On the issuing thread, before `issued` completes.
  void set(EventPtr latest) { latest_ = std::move(latest); }
  void finish() { finished_ = true; }
  void fail(std::string why) { why_ = std::move(why); }
  bool failed() const { return !why_.empty(); }  // on the issuing thread
  bool issued() const { return issued_->query(); }
  // Blocks until every task ran (or was skipped after a failure); returns the
  // last handed-over event, which covers all that was issued (null: nothing).
  // A stream that must follow the copies waits on it, not the host on them.
  EventPtr after_issued() {
    issued_->wait();
    return latest_;
  }
  bool query() override { return issued_->query() && (!latest_ || latest_->query()); }
  void wait() override;
  void wait_current(int device) override;
  double elapsed_ms_since(Event&) override { return 0.0; }

 private:
  std::shared_ptr<HostEvent> issued_;
  // Written by the issuing thread before issued_ completes, read after.
  EventPtr latest_;
  bool finished_ = false;
  std::string why_;
};

}  // namespace offcache
