#include "host_stream.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <utility>
#include <vector>

namespace offcache {
namespace {

// Every live stream, for the fork handlers.
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::vector<HostStream*>& registry() {
  static std::vector<HostStream*> streams;
  return streams;
}
std::once_flag g_atfork_once;

}  // namespace

HostStream::HostStream(std::function<void()> prepare) : prepare_(std::move(prepare)) {
  std::call_once(g_atfork_once, [] {
    pthread_atfork(&HostStream::before_fork, &HostStream::after_fork_parent,
                   &HostStream::after_fork_child);
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    start_worker_locked();
  }
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().push_back(this);
}

HostStream::~HostStream() {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), this), r.end());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_) worker_->join();
}

void HostStream::start_worker_locked() {
  worker_ = std::make_unique<std::thread>([this] { run(); });
}

void HostStream::push(std::function<void()> fn, bool always) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!worker_) start_worker_locked();  // first use in a forked child
    tasks_.push_back(Task{std::move(fn), always});
  }
  cv_.notify_one();
}

void HostStream::submit(std::function<void()> task) { push(std::move(task), false); }

std::shared_ptr<HostEvent> HostStream::record() {
  auto event = std::make_shared<HostEvent>();
  push([event] { event->complete(); }, true);
  return event;
}

std::string HostStream::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
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
    Task task;
    bool failed;
    {
      std::unique_lock<std::mutex> lock(mu_);
      running_ = false;
      idle_cv_.notify_all();
      if ((tasks_.empty() || paused_) && !stop_) {
        if (!paused_ && clock::now() - last_work < kSpin) {
          lock.unlock();
          std::this_thread::yield();
          continue;
        }
        cv_.wait(lock, [this] { return stop_ || (!tasks_.empty() && !paused_); });
      }
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      running_ = true;
      failed = !error_.empty();
    }
    if (failed && !task.always) continue;  // after a failure only events complete
    std::string what;
    try {
      if (prepare_ && !task.always) prepare_();
      task.fn();
    } catch (const std::exception& e) {
      what = e.what();
      if (what.empty()) what = "unknown error";
    } catch (...) {
      what = "unknown error";
    }
    if (!what.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = std::move(what);
    }
    last_work = clock::now();
  }
}

void HostStream::before_fork() {
  registry_mu().lock();
  const std::vector<HostStream*>& streams = registry();
  for (;;) {
    // Drain first (a queued task may wait on another stream's event). Then stop
    // every worker taking new tasks, and only then wait for each to finish the
    // task it runs: one stream paused while another still ran could leave that
    // one's task waiting forever for an event queued behind the pause (an I/O
    // task on a copy stream's, say).
    for (HostStream* s : streams) s->synchronize();
    for (HostStream* s : streams) {
      std::lock_guard<std::mutex> lock(s->mu_);
      s->paused_ = true;
    }
    bool idle = true;
    for (HostStream* s : streams) {
      std::unique_lock<std::mutex> lock(s->mu_);
      // A task still running after a while may wait for a paused stream (work
      // submitted since the drain): resume all, drain again, and try again.
      if (!s->idle_cv_.wait_for(lock, std::chrono::milliseconds(10),
                                [s] { return !s->running_; })) {
        idle = false;
        break;
      }
    }
    if (idle) break;
    for (HostStream* s : streams) {
      {
        std::lock_guard<std::mutex> lock(s->mu_);
        s->paused_ = false;
      }
      s->cv_.notify_all();
    }
  }
  // Every worker is idle and paused (it takes no task while paused_): hold each
  // stream's lock until after fork(), so no task is half-run in the child.
  for (HostStream* s : streams) s->mu_.lock();
}

void HostStream::after_fork_parent() {
  for (HostStream* s : registry()) {
    s->paused_ = false;
    s->mu_.unlock();
    s->cv_.notify_all();
  }
  registry_mu().unlock();
}

void HostStream::after_fork_child() {
  for (HostStream* s : registry()) {
    s->paused_ = false;
    s->running_ = false;
    // The worker thread does not exist in the child: forget its handle (it
    // cannot be joined) and let the next submit start a new one.
    (void)s->worker_.release();
    // The condition variables may record the parent worker as a waiter, and
    // signalling one would then wait for it forever: start them afresh.
    new (&s->cv_) std::condition_variable();
    new (&s->idle_cv_) std::condition_variable();
    if (!s->tasks_.empty()) s->start_worker_locked();
    s->mu_.unlock();
  }
  registry_mu().unlock();
}

}  // namespace offcache
