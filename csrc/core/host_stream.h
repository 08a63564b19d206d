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
#include <string>
#include <thread>

#include "event.h"

namespace offcache {

class HostStream {
 public:
  // prepare: run by the worker before each task that is not an event's completion,
  // on the worker's own thread (an owner selects its device and capture mode
  // there; it makes repeats cheap). Whatever it throws fails that task, as the
  // task's own error would.
  explicit HostStream(std::function<void()> prepare = nullptr);
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // A task that throws does not end the worker (or the process): its error is
  // kept (error()), later tasks are skipped and later events still complete,
  // so nothing waiting on the stream hangs and the owner reports the error.
  void submit(std::function<void()> task);
  // An event that completes after every task submitted before it.
  std::shared_ptr<HostEvent> record();
  // The first error a task threw ("" if none); sticky.
  std::string error();
  // Later tasks start only after `event` completes (cudaStreamWaitEvent).
  void wait_event(EventPtr event);
  // Blocks until every submitted task has run.
  void synchronize();

  // pthread_atfork handlers (registered once for every stream).
  static void before_fork();
  static void after_fork_parent();
  static void after_fork_child();

 private:
  struct Task {
    std::function<void()> fn;
    bool always;  // runs even after a failure (completes an event)
  };
  void push(std::function<void()> fn, bool always);
  void run();
  void start_worker_locked();

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Task> tasks_;
  std::string error_;  // guarded by mu_
  bool stop_ = false;
  bool running_ = false;  // the worker is running a task (outside mu_)
  bool paused_ = false;   // fork in progress: the worker takes no new task
  std::unique_ptr<std::thread> worker_;
  std::function<void()> prepare_;  // set once, before the worker starts
};

}  // namespace offcache
