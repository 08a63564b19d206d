// A "stream" for the host backend: one worker thread that runs submitted
// tasks in order. Events recorded on it complete when the worker reaches
// them, so ordering behaves like a CUDA stream's.
//
// Fork: every stream is drained and locked before fork() (pthread_atfork), so
// no task is half-run in the child; the child, which has no worker thread,
// starts a fresh one on its first submit and runs what is still queued.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
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

  // pthread_atfork handlers (registered once for every stream).
  static void before_fork();
  static void after_fork_parent();
  static void after_fork_child();

 private:
  void run();
  void start_worker_locked();

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  bool running_ = false;  // the worker is running a task (outside mu_)
  bool paused_ = false;   // fork in progress: the worker takes no new task
  std::unique_ptr<std::thread> worker_;
};

}  // namespace offcache
