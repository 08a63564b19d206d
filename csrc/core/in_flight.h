// The in-flight ledger: the batches of copies issued on the copy streams,
// oldest first, each with what its copies touch (a Payload: for the engine,
// the tensors they read and write), kept alive until the batch completes.
//
// Not thread-safe: its owner's lock guards it. What it retires is never
// destroyed under that lock: a payload's destructor may take the lock again
// (an arena tensor dying frees its block). So every retiring call puts the
// payloads into a Retiring scope, which holds the lock and on leaving,
// normally or by an exception (a query that throws on a broken CUDA
// context), releases the lock first and destroys them after.
//
// Its owner's lock is also never held while waiting for the GIL: a payload
// dying (a block's release) takes the lock on a thread that may hold the GIL.
// So the payloads' reference counts change only outside it or by moves
// (taking a strong reference to a tensor whose only owner is its Python
// object, or dropping it, increfs or decrefs that object under the GIL).
#pragma once

#include <algorithm>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "event.h"

namespace offcache {

// What one batch keeps alive, in two parts: `until_queued` may go once the
// batch's copies are queued on their stream (device memory allocated on that
// very stream: the stream orders its reuse after them), `until_done` only
// once they completed. Shared by the ledger and whoever can prove either
// earlier (a ticket's wait): the first to see it takes the payload, later
// takers get an empty one. Taken payloads are destroyed by the taker.
template <class Payload>
class Held {
 public:
  Held() = default;
  Held(Payload until_done, Payload until_queued)
      : until_done_(std::move(until_done)), until_queued_(std::move(until_queued)) {}
  // Appends the payloads to `*sink` (strong guarantee: on a throw nothing was taken).
  void take_queued(std::vector<Payload>* sink) {
    std::lock_guard<std::mutex> l(mu_);
    sink->push_back(std::move(until_queued_));
    until_queued_ = Payload();
  }
  void take_all(std::vector<Payload>* sink) {
    sink->reserve(sink->size() + 2);
    std::lock_guard<std::mutex> l(mu_);
    sink->push_back(std::move(until_queued_));
    sink->push_back(std::move(until_done_));
    until_queued_ = Payload();
    until_done_ = Payload();
  }

 private:
  std::mutex mu_;  // a leaf lock: nothing is destroyed under it
  Payload until_done_;
  Payload until_queued_;
};

// A lock held together with what is retired under it. Its members die in
// reverse order: the lock is released first, then the retired payloads.
template <class Payload, class Mutex = std::mutex>
class Retiring {
 public:
  explicit Retiring(std::unique_lock<Mutex> lock) : lock_(std::move(lock)) {}
  Retiring(Retiring&&) noexcept = default;
  std::vector<Payload>* sink() { return &retired_; }
  // Releases the lock now; the payloads still die when the scope does.
  void unlock() { lock_.unlock(); }
  bool owns_lock() const { return lock_.owns_lock(); }

 private:
  std::vector<Payload> retired_;  // declared first: destroyed last
  std::unique_lock<Mutex> lock_;
};

template <class Payload>
class InFlightLedger {
 public:
  using HeldPtr = std::shared_ptr<Held<Payload>>;
  struct Batch {
    EventPtr start;  // null unless timed
    EventPtr done;
    size_t bytes = 0;
    int dir = 0;                   // 0 or 1: bytes are bounded per direction
    const void* stream = nullptr;  // the batches of one stream complete in order
    bool bounded = true;           // counts against its direction's bound
    HeldPtr held;                  // may be null: nothing to keep
  };

  // Lists a batch whose copies are queued (strong guarantee).
  void add(Batch b) {
    batches_.push_back(std::move(b));
    const Batch& x = batches_.back();
    bytes_ += x.bytes;
    if (x.bounded) dir_bytes_[x.dir] += x.bytes;
  }

  // Retires every batch whose `done` completed (query(done) is true), asking
  // each stream only up to its first batch still running: on_retire(batch)
  // (accounting; must not throw), then its payloads go to `*sink`. A query
  // that throws leaves the ledger consistent: the batches retired before it
  // are off the ledger with their payloads in *sink, the rest stay listed.
  template <class Query, class OnRetire>
  void reap(Query&& query, OnRetire&& on_retire, std::vector<Payload>* sink) {
    std::vector<const void*> busy;
    for (auto it = batches_.begin(); it != batches_.end();) {
      if (std::find(busy.begin(), busy.end(), it->stream) != busy.end()) {
        ++it;
        continue;
      }
      if (!query(it->done)) {
        busy.push_back(it->stream);
        ++it;
        continue;
      }
      if (it->held) it->held->take_all(sink);  // before anything changes: it may throw
      on_retire(*it);
      bytes_ -= it->bytes;
      if (it->bounded) dir_bytes_[it->dir] -= it->bytes;
      it = batches_.erase(it);
    }
  }

  // The oldest bounded batch of direction `dir` (null if none): waiting for it frees bound soonest.
  EventPtr oldest(int dir) const {
    for (const Batch& b : batches_) {
      if (b.dir == dir && b.bounded) return b.done;
    }
    return nullptr;
  }
  // Every batch's completion, oldest first.
  std::vector<EventPtr> events() const {
    std::vector<EventPtr> out;
    out.reserve(batches_.size());
    for (const Batch& b : batches_) out.push_back(b.done);
    return out;
  }
  size_t bytes() const { return bytes_; }
  size_t bounded_bytes(int dir) const { return dir_bytes_[dir]; }
  size_t size() const { return batches_.size(); }

 private:
  std::deque<Batch> batches_;
  size_t bytes_ = 0;
  size_t dir_bytes_[2] = {0, 0};
};

}  // namespace offcache
