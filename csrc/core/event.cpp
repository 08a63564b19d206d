#include "event.h"

#include <stdexcept>
#include <thread>

namespace offcache {

std::shared_ptr<HostEvent> HostEvent::completed() {
  auto e = std::make_shared<HostEvent>();
  e->complete();
  return e;
}

void HostEvent::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    when_ = std::chrono::steady_clock::now();
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void HostEvent::wait() {
  // Spin briefly first: most waits are for small copies that finish within
  // microseconds, and a condition-variable wake-up costs tens of them.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (!query()) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return query(); });
      return;
    }
    std::this_thread::yield();
  }
}

double HostEvent::elapsed_ms_since(Event& start) {
  auto* s = dynamic_cast<HostEvent*>(&start);
  if (s == nullptr || !s->query() || !query()) return 0.0;
  std::lock_guard<std::mutex> lock(mu_);
  return std::chrono::duration<double, std::milli>(when_ - s->when()).count();
}

void ChainedEvent::wait() {
  issued_->wait();
  if (latest_) latest_->wait();
}

void ChainedEvent::wait_current(int device) {
  after_issued();
  if (!finished_) {
    if (latest_) latest_->wait();  // what was issued lands before anyone hears of the failure
    throw std::runtime_error(
        "offcache: the copies of this fetch were not all issued: " +
        (why_.empty() ? std::string("an earlier task of the engine's I/O thread failed (the next "
                                    "engine call names it)")
                      : why_));
  }
  if (latest_) latest_->wait_current(device);
}

}  // namespace offcache
