// Host backend: worker threads are the copy streams and copies are memcpy.
// The CUDA backend reuses it for CPU-to-CPU traffic.
#pragma once

#include <atomic>
#include <memory>

#include "backend.h"
#include "core/host_stream.h"
#include "core/page_source.h"

namespace offcache {

class HostBackend : public Backend {
 public:
  // copy_delay_us slows each emulated copy to widen race windows in tests.
  explicit HostBackend(int64_t copy_delay_us);
  std::string name() const override { return "host"; }
  ChunkSource& chunks() override { return source_; }
  const ChunkSource& chunks() const override { return source_; }
  c10::Device resolve_device(c10::Device device) const override;
  EventPtr record_current(c10::Device device) override;
  void current_wait(c10::Device device, const EventPtr& event) override;
  void copy_wait(Dir dir, c10::Device device, const EventPtr& event) override;
  void copy(Dir dir, c10::Device device, const std::vector<CopyOp>& ops) override;
  EventPtr copy_record(Dir dir, c10::Device device, bool timed) override;
  EventPtr trace_origin(c10::Device) override { return HostEvent::completed(); }
  void host_callback(Dir dir, c10::Device, std::function<void()> fn) override {
    stream(dir).submit(std::move(fn));
  }
  void mark_used_by_copy(Dir, c10::Device, const at::Tensor&) override {}

 private:
  HostStream& stream(Dir dir) { return dir == Dir::kStore ? d2h_ : h2d_; }
  PageSource source_;
  int64_t copy_delay_us_;
  HostStream d2h_;
  HostStream h2d_;
};

}  // namespace offcache
