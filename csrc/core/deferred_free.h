// Blocks whose last user is gone but which a copy may still touch. A block is
// handed back only once every fence (store and fetch events) has completed.
#pragma once

#include <cstddef>
#include <vector>

#include "arena.h"
#include "event.h"

namespace offcache {

class DeferredFrees {
 public:
  void push(const Block& block, std::vector<EventPtr> fences);
  // Releases every block whose fences are complete; returns how many.
  template <class Release>
  size_t reclaim(Release&& release) {
    size_t n = 0;
    for (size_t i = 0; i < pending_.size();) {
      if (done(pending_[i])) {
        release(pending_[i].block);
        pending_[i] = std::move(pending_.back());
        pending_.pop_back();
        ++n;
      } else {
        ++i;
      }
    }
    return n;
  }
  // Blocks until the fences of every pending block complete (host waits).
  void wait_all();
  size_t size() const { return pending_.size(); }
  size_t bytes() const;

 private:
  struct Pending {
    Block block;
    std::vector<EventPtr> fences;
  };
  static bool done(Pending& p);
  std::vector<Pending> pending_;
};

}  // namespace offcache
