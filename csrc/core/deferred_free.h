// Blocks whose last user is gone but which a copy may still touch. A block is
// handed back only once every fence (store and fetch events) has completed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "arena.h"
#include "event.h"

namespace offcache {

class DeferredFrees {
 public:
  void push(const Block& block, std::vector<EventPtr> fences);
  // Releases every block whose fences are complete (query(fence) is true for
  // each); returns how many. Exception-safe: when a query or a release throws,
  // the blocks released before it are off the list and every other block
  // stays pending, in order (none is released twice, none is lost).
  template <class Query, class Release>
  size_t reclaim(Query&& query, Release&& release) {
    // Stable compaction: the pending list stays oldest first. [0, kept) are
    // kept, [i, size) not yet visited; on every exit the gap between closes.
    size_t kept = 0, i = 0, n = 0;
    struct Close {
      std::vector<Pending>& v;
      size_t& kept;
      size_t& i;
      ~Close() {
        if (kept != i) {
          std::move(v.begin() + static_cast<std::ptrdiff_t>(i), v.end(),
                    v.begin() + static_cast<std::ptrdiff_t>(kept));
        }
        v.resize(kept + (v.size() - i));
      }
    } close{pending_, kept, i};
    for (; i < pending_.size(); ++i) {
      if (done(pending_[i], query)) {
        release(pending_[i].block);
        ++n;
      } else {
        if (kept != i) pending_[kept] = std::move(pending_[i]);
        ++kept;
      }
    }
    return n;
  }
  template <class Release>
  size_t reclaim(Release&& release) {
    return reclaim([](const EventPtr& e) { return e->query(); }, std::forward<Release>(release));
  }
  // Takes off the list the smallest pending block for which fits(block) is
  // true, whether or not its fences completed: the caller owns it with those
  // fences, and must order every write into it after them (a copy stream that
  // waits on them). nullopt when none fits.
  struct Taken {
    Block block;
    std::vector<EventPtr> fences;
  };
  template <class Fits>
  std::optional<Taken> take_fitting(Fits&& fits) {
    size_t best = pending_.size();
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (fits(pending_[i].block) &&
          (best == pending_.size() || pending_[i].block.size < pending_[best].block.size)) {
        best = i;
      }
    }
    if (best == pending_.size()) return std::nullopt;
    Taken t{pending_[best].block, std::move(pending_[best].fences)};
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(best));
    return t;
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
  template <class Query>
  static bool done(const Pending& p, Query& query) {
    for (const auto& e : p.fences) {
      if (e && !query(e)) return false;
    }
    return true;
  }
  std::vector<Pending> pending_;
};

}  // namespace offcache
