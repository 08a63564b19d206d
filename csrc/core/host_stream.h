// A "stream" for the host backend: one worker thread that runs submitted
// tasks in order. Events recorded on it complete when the worker reaches
// them, so ordering behaves like a CUDA stream's.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "event.h"

namespace offcache {

class HostStream {
 public:
  HostStream();
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  void submit(std::function<void()> task);
  // An event that completes after every task submitted before it.
  std::shared_ptr<HostEvent> record();
  // Later tasks start only after `event` completes (cudaStreamWaitEvent).
  void wait_event(EventPtr event);
  // Blocks until every submitted task has run.
  void synchronize();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace offcache
