// Python bindings for offcache._C. Copies and waits release the GIL.
#include <torch/extension.h>

#include "backends/backend_host.h"
#include "engine/engine.h"
#include "engine/engine_detail.h"
#include "region/shared_region.h"

#ifdef OFFCACHE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;
using offcache::EventPtr;

namespace {

// A copy's completion: wait() makes the consumer's current stream wait on it
// (the calling thread, for the CPU). It needs no engine: it holds the event,
// the device resolved when the copy was issued, and a share of what the
// engine keeps alive for the copies (`held`, never the outputs themselves
// once it has seen them queued or complete: a dropped output dies at once).
struct Ticket {
  EventPtr event;
  int device;  // -1: the CPU
  std::vector<offcache::HeldTensors> held;
  // Outputs on a GPU: a stream other than the fetch's that waits must keep them from reuse too.
  std::shared_ptr<offcache::Handoff> handoff;
  void wait() const {
    if (event) event->wait_current(device);
    if (handoff && device >= 0) handoff->to_current(device);
    // A CPU wait proves the copies complete, a GPU one proves them queued.
    release(/*complete=*/device < 0);
  }
  bool query() const {
    const bool done = event == nullptr || event->query();
    if (done) release(/*complete=*/true);
    return done;
  }
  void release(bool complete) const {
    std::vector<offcache::Tensors> taken;  // dies here: no lock is held
    for (const auto& h : held) complete ? h->take_all(&taken) : h->take_queued(&taken);
  }
  // False while a fetch_file's copies wait for their reads: wait() would block the host.
  bool issued() const {
    auto* chained = dynamic_cast<offcache::ChainedEvent*>(event.get());
    return chained == nullptr || chained->issued();
  }
};

Ticket ticket_for(EventPtr event, const c10::Device& device,
                  std::vector<offcache::HeldTensors> held = {},
                  std::shared_ptr<offcache::Handoff> handoff = nullptr) {
  return Ticket{std::move(event), device.is_cpu() ? -1 : device.index(), std::move(held),
                std::move(handoff)};
}

// Every call that uses an engine releases the GIL first, so other Python
// threads run while it copies or waits. The engine's lock is never held while
// waiting for the GIL (engine.h): a thread holding the GIL may wait for it
// (a dying block's release does), never the other way round.
py::dict stats_dict() {
  offcache::EngineStats s;
  bool pinned;
  std::pair<size_t, size_t> retired;
  {
    py::gil_scoped_release release;
    offcache::EngineUse use;
    s = use->stats();
    pinned = use->arena_pinned();
    retired = offcache::retired_engines();
  }
  py::dict d;
#define OFFCACHE_FIELD(name) d[#name] = s.name
  OFFCACHE_FIELD(pinned_reserved_bytes);
  OFFCACHE_FIELD(pinned_in_use_bytes);
  OFFCACHE_FIELD(pageable_bytes);
  OFFCACHE_FIELD(in_flight_bytes);
  OFFCACHE_FIELD(deferred_bytes);
  OFFCACHE_FIELD(peak_pinned_reserved_bytes);
  OFFCACHE_FIELD(peak_pinned_in_use_bytes);
  OFFCACHE_FIELD(peak_pageable_bytes);
  OFFCACHE_FIELD(peak_in_flight_bytes);
  OFFCACHE_FIELD(peak_host_bytes);
  OFFCACHE_FIELD(dedup_hits);
  OFFCACHE_FIELD(spills);
  OFFCACHE_FIELD(blocks_reused_in_order);
  OFFCACHE_FIELD(staging_reserved_bytes);
  OFFCACHE_FIELD(stores);
  OFFCACHE_FIELD(fetches);
  OFFCACHE_FIELD(output_allocations);
  OFFCACHE_FIELD(output_alloc_retries);
  OFFCACHE_FIELD(consumer_pool_fetches);
  OFFCACHE_FIELD(handovers);
  OFFCACHE_FIELD(d2h_bytes);
  OFFCACHE_FIELD(h2d_bytes);
  OFFCACHE_FIELD(d2h_copies);
  OFFCACHE_FIELD(h2d_copies);
  OFFCACHE_FIELD(d2h_seconds);
  OFFCACHE_FIELD(h2d_seconds);
  OFFCACHE_FIELD(pinned_limit_bytes);
  OFFCACHE_FIELD(dedup_entries);
  OFFCACHE_FIELD(snapshot_bytes);
  OFFCACHE_FIELD(snapshot_fallbacks);
  OFFCACHE_FIELD(inline_store_copies);
  OFFCACHE_FIELD(snapshot_oom_skips);
  OFFCACHE_FIELD(chunk_bytes);
  OFFCACHE_FIELD(chunk_seconds);
  OFFCACHE_FIELD(lock_waits_over_1ms);
  OFFCACHE_FIELD(leaked_blocks);
  OFFCACHE_FIELD(events_created);
  OFFCACHE_FIELD(events_recorded);
  OFFCACHE_FIELD(stream_waits);
  OFFCACHE_FIELD(copy_calls);
  OFFCACHE_FIELD(host_callbacks);
  OFFCACHE_FIELD(pinned_registrations);
  OFFCACHE_FIELD(syncs);
  OFFCACHE_FIELD(event_queries);
  OFFCACHE_FIELD(pinned_queries);
  OFFCACHE_FIELD(packed_spans);
  OFFCACHE_FIELD(packed_span_bytes);
  OFFCACHE_FIELD(packed_output_bytes);
  OFFCACHE_FIELD(threads_prepared);
  OFFCACHE_FIELD(chunks_made);
  OFFCACHE_FIELD(chunks_released);
  OFFCACHE_FIELD(chunks_kept_registered);
  OFFCACHE_FIELD(host_limit_bytes);
  OFFCACHE_FIELD(disk_bytes);
  OFFCACHE_FIELD(disk_reserved_bytes);
  OFFCACHE_FIELD(peak_disk_bytes);
  OFFCACHE_FIELD(disk_files);
  OFFCACHE_FIELD(disk_write_bytes);
  OFFCACHE_FIELD(disk_read_bytes);
  OFFCACHE_FIELD(disk_write_seconds);
  OFFCACHE_FIELD(disk_read_seconds);
  OFFCACHE_FIELD(disk_fallbacks);
  OFFCACHE_FIELD(bounce_reserved_bytes);
  OFFCACHE_FIELD(bounce_pageable);
  OFFCACHE_FIELD(file_fetches);
  OFFCACHE_FIELD(file_read_bytes);
  OFFCACHE_FIELD(file_cached_reads);
  OFFCACHE_FIELD(file_buffered_reads);
  OFFCACHE_FIELD(file_read_seconds);
#undef OFFCACHE_FIELD
  // Process-wide: the shared mappings (offcache.weights.node's region) this process holds.
  const offcache::SharedStats sh = offcache::shared_stats();
  d["shared_mapped_bytes"] = sh.mapped_bytes;
  d["shared_registered_bytes"] = sh.registered_bytes;
  d["shared_pinned_share_bytes"] = sh.pinned_share_bytes;
  d["shared_mappings"] = sh.mappings;
  d["shared_registrations"] = sh.registrations;
  d["shared_register_failures"] = sh.register_failures;
  d["shared_unregister_failures"] = sh.unregister_failures;
  d["shared_register_seconds"] = sh.register_seconds;
  d["shared_fetches"] = sh.fetches;
  d["shared_fetch_bytes"] = sh.fetch_bytes;
  d["shared_pinned_fetch_bytes"] = sh.pinned_fetch_bytes;
  d["shared_deferred_unmaps"] = sh.deferred_unmaps;
  d["pinned"] = pinned;
  d["retired_engines"] = retired.first;
  d["retired_reserved_bytes"] = retired.second;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offcache engine: pinned host arena, dedup table and copy streams";

  py::register_exception<offcache::HostLimitError>(m, "HostLimitError", PyExc_MemoryError);

  py::class_<Ticket>(m, "Ticket")
      .def("wait", &Ticket::wait, py::call_guard<py::gil_scoped_release>(),
           "Make the consumer's current stream wait for the fetch's copies.")
      .def("query", &Ticket::query, py::call_guard<py::gil_scoped_release>())
      .def("issued", &Ticket::issued,
           "False while a fetch_file's copies still wait for their reads (wait() blocks then).");

  m.def(
      "store",
      [](const std::vector<at::Tensor>& values, c10::Device device, bool allow_spill) {
        return offcache::EngineUse()->store(values, device, allow_spill);
      },
      py::arg("values"), py::arg("device"), py::arg("allow_spill") = true,
      py::call_guard<py::gil_scoped_release>(),
      "Copy tensors to `device` (CPU: the pinned arena). Returns the copies in order.");
  m.def(
      "fetch",
      [](const std::vector<at::Tensor>& stored, c10::Device device, bool wait) {
        offcache::EngineUse use;  // held for the whole call
        auto& engine = *use;
        device = engine.backend().resolve_device(device, /*waits_only=*/true);
        auto f = engine.fetch(stored, device, wait);
        return std::make_pair(std::move(f.tensors),
                              ticket_for(std::move(f.done), device, std::move(f.held), f.handoff));
      },
      py::arg("stored"), py::arg("device"), py::arg("wait") = true,
      py::call_guard<py::gil_scoped_release>(),
      "Copy stored tensors to `device`. Returns (tensors, ticket).");
  m.def(
      "fetch_file",
      [](const std::string& path, const std::vector<int64_t>& offsets,
         const std::vector<at::Tensor>& likes, c10::Device device, bool wait) {
        offcache::EngineUse use;  // held for the whole call
        auto& engine = *use;
        device = engine.backend().resolve_device(device, /*waits_only=*/true);
        auto f = engine.fetch_file(path, offsets, likes, device, wait);
        return std::make_pair(std::move(f.tensors),
                              ticket_for(std::move(f.done), device, std::move(f.held), f.handoff));
      },
      py::arg("path"), py::arg("offsets"), py::arg("likes"), py::arg("device"),
      py::arg("wait") = true, py::call_guard<py::gil_scoped_release>(),
      "Read tensors (likes[i]'s dtype and shape) from byte offsets of a file onto `device`. "
      "Returns (tensors, ticket).");
  m.def(
      "copy_into",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs, bool wait) {
        offcache::EngineUse use;  // held for the whole call
        auto& engine = *use;
        EventPtr done = engine.copy_into(dsts, srcs, wait);
        // The ticket orders a GPU's current stream: a destination's (H2D), else
        // a source's (D2H: later work may overwrite the source). The host side
        // of a D2H is read after wait_stored() (its block records the copy).
        c10::Device consumer(c10::kCPU);
        for (const auto& d : dsts) {
          if (!d.device().is_cpu())
            consumer = engine.backend().resolve_device(d.device(), /*waits_only=*/true);
        }
        for (size_t i = 0; consumer.is_cpu() && i < srcs.size(); ++i) {
          if (!srcs[i].device().is_cpu())
            consumer = engine.backend().resolve_device(srcs[i].device(), /*waits_only=*/true);
        }
        return ticket_for(std::move(done), consumer);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("wait") = false,
      py::call_guard<py::gil_scoped_release>(),
      "Copy srcs[i] into the existing dsts[i] on the copy streams. Returns a ticket.");
  m.def(
      "set_timing", [](bool on) { offcache::EngineUse()->set_timing(on); }, py::arg("on"),
      py::call_guard<py::gil_scoped_release>(),
      "Time every copy batch (d2h_seconds / h2d_seconds in stats) with timed events.");
  m.def(
      "synchronize", [] { offcache::synchronize_all(); }, py::call_guard<py::gil_scoped_release>());
  m.def(
      "wait_stored", [](const at::Tensor& t) { offcache::EngineUse()->wait_stored(t); },
      py::call_guard<py::gil_scoped_release>(),
      "Block until the store that produced `t` has written it.");
  m.def(
      "empty_cache", [] { return offcache::EngineUse()->empty_cache(); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "trace_start", [](c10::Device device) { offcache::EngineUse()->trace_start(device); },
      py::call_guard<py::gil_scoped_release>(),
      "Record copy batches from now on, timed from an event on `device`'s current stream.");
  m.def("trace_stop", [] {
    std::vector<offcache::Engine::TraceRow> rows;
    {
      py::gil_scoped_release release;
      rows = offcache::EngineUse()->trace_stop();
    }
    py::list out;
    for (const auto& r : rows) {
      py::dict d;
      d["stream"] = r.dir == offcache::Dir::kStore ? "d2h" : "h2d";
      d["bytes"] = r.bytes;
      d["start_ms"] = r.start_ms;
      d["end_ms"] = r.end_ms;
      out.append(d);
    }
    return out;
  });
  m.def("stats", &stats_dict);
  m.def("_fail_next_copy", &offcache::HostCopyStream::fail_next_copy,
        "Tests: the next host copy call queues its copies, then raises.");
  m.def("_fail_next_task", &offcache::HostCopyStream::fail_next_task,
        "Tests: the next host copy task fails on its worker thread.");
  m.def("_fail_query_after", &offcache::Backend::fail_query_after, py::arg("skip"),
        py::arg("transient") = false,
        "Tests: the event query after the next `skip` ones raises, once (transient: as during "
        "another thread's graph capture; else as on a broken CUDA context); skip < 0 disarms. "
        "Returns whether a fault armed before had not fired yet.");
  m.def(
      "set_pinned_limit", [](size_t bytes) { offcache::EngineUse()->set_limit(bytes); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "take_spill_notice", [] { return offcache::EngineUse()->take_spill_notice(); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "backend_name", [] { return offcache::EngineUse()->backend().name(); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "is_arena_tensor",
      [](const at::Tensor& t) { return offcache::EngineUse()->is_arena_tensor(t); },
      py::call_guard<py::gil_scoped_release>());
  m.def("is_offcache_tensor",
        [](const at::Tensor& t) { return offcache::host_block_of(t) != nullptr; });
  m.def("is_disk_tensor", [](const at::Tensor& t) {
    const offcache::HostBlock* hb = offcache::host_block_of(t);
    return hb != nullptr && hb->disk();
  });
  m.def("allocation_of", &offcache::detail::allocation_of);
  m.def(
      "map_shared",
      [](int fd, size_t offset, size_t bytes, size_t ranks) {
        offcache::EngineUse use;  // held for the whole call
        auto& engine = *use;
        engine.backend().check_process();
        const bool cuda = engine.backend().kind() == offcache::BackendKind::kCuda;
        // The engine's GPU: the (un)registrations select it on whatever thread runs them.
        const int device = engine.backend().claim_device();
        offcache::SharedMapping m =
            offcache::map_shared(fd, offset, bytes, ranks, cuda, device, engine.pinned_budget());
        engine.refresh_shared_share();
        return std::make_pair(std::move(m.bytes), std::move(m.reason));
      },
      py::arg("fd"), py::arg("offset"), py::arg("bytes"), py::arg("ranks"),
      py::call_guard<py::gil_scoped_release>(),
      "Map and register [offset, offset + bytes) of a shared file. Returns (uint8 tensor, reason "
      "it is not registered or '').");
  m.def("is_shared_tensor",
        [](const at::Tensor& t) { return offcache::shared_span_of(t) != nullptr; });
  m.def("is_pinned_shared_tensor", [](const at::Tensor& t) {
    const offcache::SharedSpan* s = offcache::shared_span_of(t);
    return s != nullptr && s->registered;
  });
  m.def("wait_shared_reads", &offcache::wait_shared_reads, py::call_guard<py::gil_scoped_release>(),
        "Block until the copies reading a shared mapping's bytes completed.");
  m.def("shared_word_add", &offcache::shared_word_add, py::arg("word"), py::arg("delta"),
        "Atomically add to an 8-byte word of shared memory; returns the new value.");
  m.def("_fail_register", &offcache::fail_register, py::arg("after"), py::arg("reason"),
        "Tests: the registration of chunk `after` of the next map_shared fails, once.");
  m.def("_set_register_chunk", &offcache::set_register_chunk, py::arg("chunk"),
        "Tests: the largest registration of a shared mapping (0: 64 GiB).");
  m.def("configure", &offcache::configure_global_engine, py::arg("backend"),
        py::arg("pinned_limit"), py::arg("min_chunk"), py::arg("max_in_flight"),
        py::arg("host_copy_delay_us"), py::arg("disk_dir") = "", py::arg("host_limit") = SIZE_MAX,
        py::call_guard<py::gil_scoped_release>(),
        "Replace the process-wide engine (earlier stored tensors keep working).");
  // The engine's messages format numbers through libstdc++'s streams (c10::str). A compiler that
  // links pieces of libstdc++ into this module (Red Hat devtoolset's libstdc++_nonshared.a) gives
  // it a second std::locale::id numbering: numbers then come out empty or crash the process.
  // setup.py calls this right after the build; tests/test_build_checks.py too.
  m.def(
      "_format_check", [](uint64_t value) { return c10::str("[", value, ", ", 0.5, "]"); },
      py::arg("value"), "Build check: the string '[value, 0.5]' as the engine formats it.");
  m.attr("cuda_compiled") = offcache::cuda_compiled();
  m.attr("torch_version") = OFFCACHE_TORCH_VERSION;
#ifdef OFFCACHE_WITH_CUDA
  m.attr("cuda_version") =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#else
  m.attr("cuda_version") = py::none();
#endif
}
