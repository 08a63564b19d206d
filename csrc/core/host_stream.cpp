#include "host_stream.h"

#include <chrono>

namespace offcache {

HostStream::HostStream() : worker_([this] { run(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void HostStream::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

std::shared_ptr<HostEvent> HostStream::record() {
  auto event = std::make_shared<HostEvent>();
  submit([event] { event->complete(); });
  return event;
}

void HostStream::wait_event(EventPtr event) {
  if (event == nullptr || event->query()) return;
  submit([event = std::move(event)] { event->wait(); });
}

void HostStream::synchronize() { record()->wait(); }

void HostStream::run() {
  using clock = std::chrono::steady_clock;
  // After finishing work the worker polls for a short while before sleeping,
  // so back-to-back small copies do not each pay a thread wake-up.
  constexpr auto kSpin = std::chrono::microseconds(100);
  auto last_work = clock::now();
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (tasks_.empty() && !stop_) {
        if (clock::now() - last_work < kSpin) {
          lock.unlock();
          std::this_thread::yield();
          continue;
        }
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      }
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
    last_work = clock::now();
  }
}

}  // namespace offcache
