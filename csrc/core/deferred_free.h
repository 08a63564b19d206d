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
    // Stable compaction: the pending list stays oldest first.
    size_t kept = 0, n = 0;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (done(pending_[i])) {
        release(pending_[i].block);
        ++n;
      } else {
        if (kept != i) pending_[kept] = std::move(pending_[i]);
        ++kept;
      }
    }
    pending_.resize(kept);
    return n;
  }
  // Blocks until the fences of every pending block complete (host waits).
  void wait_all();
  // A fence of the oldest pending block that has not completed (null if none):
  // waiting for it, without a lock, frees memory soonest.
  EventPtr oldest_fence() const;
  // Drops every pending block without releasing it (their copies' fate is unknown).
  void forget() { pending_.clear(); }
  size_t size() const { return pending_.size(); }
  size_t bytes() const;
  // Bytes of the pending blocks for which keep(block) is true.
  template <class Keep>
  size_t bytes_where(Keep&& keep) const {
    size_t total = 0;
    for (const auto& p : pending_) {
      if (keep(p.block)) total += p.block.size;
    }
    return total;
  }

 private:
  struct Pending {
    Block block;
    std::vector<EventPtr> fences;
  };
  static bool done(Pending& p);
  std::vector<Pending> pending_;
};

}  // namespace offcache
