// Host backend: worker threads are the copy streams and copies are memcpy.
// The CUDA backend reuses its copy streams for CPU-to-CPU traffic.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "backend.h"
#include "core/host_stream.h"
#include "core/page_source.h"

namespace offcache {

class HostCopyStream final : public CopyStream {
 public:
  // copy_delay_us slows each emulated copy to widen race windows in tests.
  // prepare: the owning backend's prepare_thread, run on the worker (HostStream).
  HostCopyStream(Counters& counters, int64_t copy_delay_us, std::function<void()> prepare)
      : counters_(counters), copy_delay_us_(copy_delay_us), stream_(std::move(prepare)) {}
  void wait(const EventPtr& event) override;
  void copy(const std::vector<CopyOp>& ops) override;
  EventPtr record(bool timed) override;
  EventPtr copy_after(const std::vector<EventPtr>& deps, const std::vector<CopyOp>& ops) override;
  void enter(const std::function<void()>& fn) override { fn(); }
  void synchronize_noexcept() noexcept override;
  // Tests: the next copy call queues its copies, then fails (an enqueue error).
  static void fail_next_copy();
  // Tests: the next copy task fails on the worker (as a CUDA event wait can).
  static void fail_next_task();
  std::string error() { return stream_.error(); }

 private:
  Counters& counters_;
  int64_t copy_delay_us_;
  HostStream stream_;
};

class HostBackend : public Backend {
 public:
  explicit HostBackend(int64_t copy_delay_us);
  BackendKind kind() const override { return BackendKind::kHost; }
  ChunkSource& chunks() override { return counted_; }
  const ChunkSource& chunks() const override { return counted_; }
  c10::Device resolve_device(c10::Device device, bool waits_only = false) const override;
  EventPtr record_current(c10::Device device) override;
  void current_wait(c10::Device device, const EventPtr& event) override;
  CopyStream& copy_stream(Dir dir, c10::Device device) override;
  EventPtr trace_origin(c10::Device) override { return HostEvent::completed(); }
  void hand_over(const at::Tensor&, c10::Device) override {}
  void enable_peer_access(c10::Device, c10::Device) override {}
  void prepare_thread() override;
  std::string stream_error() override;
  bool copies_host_stores_inline() const override { return copy_delay_us_ == 0; }

 private:
  int64_t copy_delay_us_;
  PageSource source_;
  CountedChunks counted_{source_, counters};
  HostCopyStream d2h_;
  HostCopyStream h2d_;
};

}  // namespace offcache
