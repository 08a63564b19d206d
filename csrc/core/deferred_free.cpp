#include "deferred_free.h"

namespace offcache {

void DeferredFrees::push(const Block& block, std::vector<EventPtr> fences) {
  pending_.push_back(Pending{block, std::move(fences)});
}

void DeferredFrees::wait_all() {
  for (auto& p : pending_) {
    for (auto& e : p.fences) {
      if (e) e->wait();
    }
  }
}

EventPtr DeferredFrees::oldest_fence() const {
  for (const auto& p : pending_) {
    for (const auto& e : p.fences) {
      if (e && !e->query()) return e;
    }
  }
  return nullptr;
}

size_t DeferredFrees::bytes() const {
  size_t total = 0;
  for (const auto& p : pending_) total += p.block.size;
  return total;
}

}  // namespace offcache
