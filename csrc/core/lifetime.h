// When a replaced object (an engine retired by configure()) may be deleted.
// It still serves what it made: blocks its tensors hold, and calls that
// entered it. It goes when it is retired, holds no block and no call uses it,
// exactly once, whichever of those three ends last and on whichever thread.
//
// Lifetime counts one object's users; RetiredSet lists the retired objects.
// A retired object is only entered through RetiredSet::enter_all(), under the
// set's lock, and deleted only through take_if_idle(), under the same lock:
// so an object entered meanwhile is not deleted under its user, and one
// already taken is no longer listed (no second delete).
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <vector>

namespace offcache {

class Lifetime {
 public:
  void add_block() {
    std::lock_guard<std::mutex> lock(mu_);
    ++blocks_;
  }
  void enter() {
    std::lock_guard<std::mutex> lock(mu_);
    ++active_;
  }
  // Each returns true when the object may have become deletable: the caller
  // then asks RetiredSet::take_if_idle, which decides.
  bool release_block() {
    std::lock_guard<std::mutex> lock(mu_);
    --blocks_;
    return idle_locked();
  }
  bool leave() {
    std::lock_guard<std::mutex> lock(mu_);
    --active_;
    return idle_locked();
  }
  bool retire() {
    std::lock_guard<std::mutex> lock(mu_);
    retired_ = true;
    return idle_locked();
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_locked();
  }

 private:
  bool idle_locked() const { return retired_ && blocks_ == 0 && active_ == 0; }
  std::mutex mu_;
  size_t blocks_ = 0, active_ = 0;
  bool retired_ = false;
};

// T has `Lifetime& lifetime()`.
template <class T>
class RetiredSet {
 public:
  // Retires `t`; true when it is idle already (the caller deletes it now),
  // else it is listed until take_if_idle() hands it out.
  bool retire(T* t) {
    std::lock_guard<std::mutex> lock(mu_);
    if (t->lifetime().retire()) return true;
    list_.push_back(t);
    return false;
  }
  // Every listed object, entered: none is deleted until the caller leaves it.
  std::vector<T*> enter_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (T* t : list_) t->lifetime().enter();
    return list_;
  }
  // `t` if it is listed and idle now, unlisted (the caller deletes it); else nullptr.
  T* take_if_idle(T* t) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(list_.begin(), list_.end(), t);
    if (it == list_.end() || !t->lifetime().idle()) return nullptr;
    list_.erase(it);
    return t;
  }
  // Calls fn(t) for each listed object under the lock (it must not delete any).
  template <class Fn>
  void for_each(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (T* t : list_) fn(t);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return list_.size();
  }
  // Fork: the set stays locked from before fork() until after it, so no
  // object is taken (and deleted) meanwhile; returns the listed objects.
  std::vector<T*> lock_for_fork() {
    mu_.lock();
    return list_;
  }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  std::mutex mu_;
  std::vector<T*> list_;
};

}  // namespace offcache
