#include "backend_host.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace offcache {
namespace {
std::atomic<int> g_fail_copies{0};
std::atomic<int> g_fail_tasks{0};
}  // namespace

std::atomic<bool> Backend::query_faults_armed{false};
namespace {
std::mutex g_query_fault_mu;
int g_query_skip = 0;
bool g_query_transient = false;
}  // namespace

bool Backend::fail_query_after(int skip, bool transient) {
  std::lock_guard<std::mutex> l(g_query_fault_mu);
  const bool pending = query_faults_armed.load();
  g_query_skip = skip;
  g_query_transient = transient;
  query_faults_armed.store(skip >= 0);
  return pending;
}

void Backend::maybe_fail_query() {
  bool transient;
  {
    std::lock_guard<std::mutex> l(g_query_fault_mu);
    if (!query_faults_armed.load() || g_query_skip-- > 0) return;
    query_faults_armed.store(false);
    transient = g_query_transient;
  }
  if (transient) throw EventUnknown("offcache: injected transient event-query failure (tests)");
  throw std::runtime_error("offcache: injected event-query failure (tests)");
}

void HostCopyStream::fail_next_copy() { ++g_fail_copies; }
void HostCopyStream::fail_next_task() { ++g_fail_tasks; }

void HostCopyStream::wait(const EventPtr& event) {
  if (event == nullptr || event->query()) return;
  ++counters_.stream_waits;
  stream_.wait_event(event);
}

namespace {

void run_copies(const std::vector<CopyOp>& ops, int64_t delay_us) {
  for (const auto& op : ops) {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    for (size_t r = 0; r < op.rows; ++r) {
      std::memcpy(static_cast<char*>(op.dst) + r * op.dst_pitch,
                  static_cast<const char*>(op.src) + r * op.src_pitch, op.bytes);
    }
  }
}

}  // namespace

void HostCopyStream::copy(const std::vector<CopyOp>& ops) {
  counters_.copy_calls += ops.size();
  // One task for the whole batch: the host analogue of a batch of copy calls.
  stream_.submit([ops, delay = copy_delay_us_] {
    if (g_fail_tasks.load() > 0 && g_fail_tasks.fetch_sub(1) > 0) {
      throw std::runtime_error("injected copy-task failure (tests)");
    }
    run_copies(ops, delay);
  });
  if (g_fail_copies.load() > 0 && g_fail_copies.fetch_sub(1) > 0) {
    TORCH_CHECK(false, "offcache: injected copy failure (tests)");
  }
}

EventPtr HostCopyStream::record(bool) {
  // A host event is a fresh flag, not a driver object: counted as recorded only.
  ++counters_.events_recorded;
  return stream_.record();
}

EventPtr HostCopyStream::copy_after(const std::vector<EventPtr>& deps,
                                    const std::vector<CopyOp>& ops) {
  for (const auto& dep : deps) {
    if (dep == nullptr || dep->query()) continue;
    ++counters_.stream_waits;
    dep->wait();  // recorded before this call: its work never waits for the caller
  }
  counters_.copy_calls += ops.size();
  run_copies(ops, copy_delay_us_);
  return nullptr;
}

void HostCopyStream::synchronize_noexcept() noexcept {
  try {
    stream_.synchronize();
  } catch (...) {  // NOLINT(bugprone-empty-catch): best effort while unwinding
  }
}

// The workers call it only for tasks, submitted once the backend is made.
HostBackend::HostBackend(int64_t copy_delay_us)
    : copy_delay_us_(copy_delay_us),
      d2h_(counters, copy_delay_us, [this] { prepare_thread(); }),
      h2d_(counters, copy_delay_us, [this] { prepare_thread(); }) {}

void HostBackend::prepare_thread() {
  // Nothing to select on the host: counted, so tests see every engine thread run it.
  thread_local const Backend* prepared_for = nullptr;
  if (prepared_for == this) return;
  prepared_for = this;
  ++counters.threads_prepared;
}

c10::Device HostBackend::resolve_device(c10::Device device, bool /*waits_only*/) const {
  TORCH_CHECK(device.is_cpu(), "offcache: the host backend handles CPU tensors only, got ", device,
              "; unset OFFCACHE_BACKEND=host to use the CUDA backend");
  return device;
}

EventPtr HostBackend::record_current(c10::Device) {
  // CPU producers and consumers are synchronous: their work is already done.
  return HostEvent::completed();
}

void HostBackend::current_wait(c10::Device device, const EventPtr& event) {
  if (event == nullptr || wait_chained(device, event)) return;
  if (!event->query()) sync(event);
}

std::string HostBackend::stream_error() {
  std::string e = d2h_.error();
  return e.empty() ? h2d_.error() : e;
}

CopyStream& HostBackend::copy_stream(Dir dir, c10::Device) {
  return dir == Dir::kStore ? d2h_ : h2d_;
}

}  // namespace offcache
