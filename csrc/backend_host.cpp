#include "backend_host.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace offcache {

HostBackend::HostBackend(int64_t copy_delay_us) : copy_delay_us_(copy_delay_us) {}

c10::Device HostBackend::resolve_device(c10::Device device) const {
  TORCH_CHECK(device.is_cpu(), "offcache: the host backend handles CPU tensors only, got ", device,
              "; unset OFFCACHE_BACKEND=host to use the CUDA backend");
  return device;
}

EventPtr HostBackend::record_current(c10::Device) {
  // CPU producers and consumers are synchronous: their work is already done.
  return HostEvent::completed();
}

void HostBackend::current_wait(c10::Device, const EventPtr& event) {
  if (event) event->wait();
}

void HostBackend::copy_wait(Dir dir, c10::Device, const EventPtr& event) {
  stream(dir).wait_event(event);
}

void HostBackend::copy(Dir dir, c10::Device, const std::vector<CopyOp>& ops) {
  // One task for the whole batch: the host analogue of one batched copy call.
  stream(dir).submit([ops, delay = copy_delay_us_] {
    for (const auto& op : ops) {
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      std::memcpy(op.dst, op.src, op.bytes);
    }
  });
}

EventPtr HostBackend::copy_record(Dir dir, c10::Device, bool) { return stream(dir).record(); }

}  // namespace offcache
