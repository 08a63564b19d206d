// Engine::fetch_file: tensors read from byte ranges of a file (a checkpoint's
// safetensors shard) straight onto a device, never copying the file.
//
// The file is read in kDiskPiece pieces (from the page cache where all of a
// piece is there, else O_DIRECT) into the engine's ring of bounce slots
// (pinned on CUDA, one for every fetch_file). Its own I/O thread reads a piece
// and then issues that piece's copies on the fetch stream itself, so the
// calling thread never waits for the disk and the copy engine copies piece k
// while the disk reads piece k + 1. A slot is read into again only after the
// copies of its previous piece have completed. The call returns a
// ChainedEvent: complete once every copy issued for it is. A read that fails
// fails that fetch only (ticket.wait() names the file and the reason); a copy
// that fails is sticky, like every copy-stream error.
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "engine.h"
#include "engine_detail.h"

namespace offcache {

using namespace detail;  // NOLINT(build/namespaces): the engine's own helpers

namespace {

// Ranges closer than this are read as one span: one more read costs more than the gap.
constexpr size_t kFileGap = size_t{1} << 20;
// The ring: 8 slots of kDiskPiece, one bounce chunk, shared by every fetch_file.
constexpr size_t kFileRing = 8;

struct Range {
  size_t begin, end, index;  // file bytes [begin, end) of output `index`
};

// Bytes [at, at + bytes) of a slot, copied to `dst`.
struct SlotCopy {
  void* dst;
  size_t at, bytes;
};

// One read: file bytes [offset, offset + length), aligned, of which `need` must exist.
struct Piece {
  size_t offset, length, need;
  std::vector<SlotCopy> copies;
};

}  // namespace

char* Engine::file_ring() {
  {
    auto l = lock();
    if (file_ring_) return static_cast<char*>(file_ring_->ptr);
  }
  // A chunk of its own from the backend (pinned on CUDA), made without the lock: never
  // from the bounce arena, which the disk tier may have filled, leaving the ring pageable
  // (its copies blocking) for the engine's life. Pageable only if the OS refuses to pin.
  const size_t size = kFileRing * kDiskPiece;
  std::string why;
  Block block{backend_->chunks().allocate(size, &why), size, kRingChunk, 0};
  if (block.ptr == nullptr) {
    auto l = lock();
    char* ring = nullptr;
    block = allocate_pageable_bounce_locked(size, &ring);
  }
  auto l = lock();
  if (file_ring_) {  // another thread's came first
    free_block(block);
    return static_cast<char*>(file_ring_->ptr);
  }
  file_ring_ = block;
  file_slot_reads_.resize(kFileRing);
  return static_cast<char*>(block.ptr);
}

Engine::Fetched Engine::fetch_file(const std::string& path, const std::vector<int64_t>& offsets,
                                   const std::vector<at::Tensor>& likes, c10::Device device,
                                   bool wait) {
  check_streams();
  device = backend_->resolve_device(device, /*waits_only=*/true);  // the consumer
  TORCH_CHECK_VALUE(offsets.size() == likes.size(), "offcache: fetch_file got ", offsets.size(),
                    " offsets for ", likes.size(), " tensors");
  TORCH_CHECK_VALUE(path.find('\0') == std::string::npos,
                    "offcache: fetch_file: the path contains a NUL byte");
  std::string why;
  std::shared_ptr<ReadOnlyFile> file = ReadOnlyFile::open(path, &why);
  TORCH_CHECK(file != nullptr, "offcache: ", why);
  const size_t n = likes.size();
  std::vector<Range> ranges;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_TYPE(likes[i].defined() && likes[i].layout() == c10::kStrided,
                     "offcache: fetch_file: tensor ", i, " of ", path, " must be a dense tensor");
    const size_t bytes = static_cast<size_t>(likes[i].numel()) * likes[i].element_size();
    TORCH_CHECK_VALUE(offsets[i] >= 0 && static_cast<size_t>(offsets[i]) <= file->size &&
                          bytes <= file->size - static_cast<size_t>(offsets[i]),
                      "offcache: fetch_file: tensor ", i, " of ", path, " needs bytes [",
                      offsets[i], ", ", offsets[i] + static_cast<int64_t>(bytes),
                      ") but the file has ", file->size);
    if (bytes > 0) {
      ranges.push_back(Range{static_cast<size_t>(offsets[i]), offsets[i] + bytes, i});
    }
  }
  CopyStream& stream = backend_->copy_stream(Dir::kFetch, device);
  // Outputs come from the copy stream's pool, as fetch's do.
  std::vector<at::Tensor> out(n);
  stream.enter([&] {
    for (size_t i = 0; i < n; ++i) {
      out[i] = at::empty(likes[i].sizes(), likes[i].options().device(device).requires_grad(false));
    }
  });
  if (ranges.empty()) return {std::move(out), nullptr};

  // Spans in file order, merged across small gaps, cut into aligned pieces; each
  // output's bytes are copied from every piece that holds some of them.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Piece> pieces;
  size_t total = 0;
  for (size_t r = 0; r < ranges.size();) {
    const size_t begin = ranges[r].begin / kDiskAlign * kDiskAlign;
    size_t end = ranges[r].end;
    for (; r < ranges.size() && ranges[r].begin <= end + kFileGap; ++r) {
      end = std::max(end, ranges[r].end);
      total += ranges[r].end - ranges[r].begin;
    }
    end = align_up(end, kDiskAlign);
    for (size_t at = begin; at < end; at += kDiskPiece) {
      const size_t length = std::min(kDiskPiece, end - at);
      pieces.push_back(Piece{at, length, std::min(length, file->size - at), {}});
    }
  }
  size_t copies = 0;
  for (Piece& p : pieces) {
    for (const Range& r : ranges) {
      const size_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.length);
      if (lo >= hi) continue;
      p.copies.push_back(SlotCopy{static_cast<char*>(out[r.index].data_ptr()) + (lo - r.begin),
                                  lo - p.offset, hi - lo});
    }
    copies += p.copies.size();
  }

  HostStream& io = io_stream(file_io_);
  char* ring = file_ring();
  auto chained = std::make_shared<ChainedEvent>();
  try {
    for (size_t k = 0; k < pieces.size(); ++k) {
      io.submit([this, &stream, file, chained, ring, last = k + 1 == pieces.size(),
                 piece = std::move(pieces[k])] {
        if (chained->failed()) return;  // an earlier piece of this fetch failed
        try {
          const size_t s = file_next_slot_++ % kFileRing;
          char* slot = ring + s * kDiskPiece;
          if (EventPtr& previous = file_slot_reads_[s]) {
            previous->wait();  // the slot's last copies have read it
            previous.reset();
          }
          const auto t0 = std::chrono::steady_clock::now();
          std::string why;
          bool buffered = false;
          const DiskSource::Where where = file->at(static_cast<off_t>(piece.offset));
          if (read_if_cached(where, slot, piece.length, piece.need)) {
            ++file_cached_reads_;  // a checkpoint still in the page cache: no disk read
          } else if (!disk_read(where, slot, piece.length, &why, &buffered, piece.need)) {
            // This fetch fails, not the engine.
            chained->fail("reading " + file->path + ": " + why);
            return;
          } else if (buffered) {
            ++file_buffered_reads_;
          }
          file_read_bytes_ += piece.need;
          file_read_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count();
          std::vector<CopyOp> ops;
          for (const SlotCopy& c : piece.copies) ops.push_back(CopyOp{c.dst, slot + c.at, c.bytes});
          // Every piece hands its copies' event over: if a later piece fails, the chain still
          // completes only after the copies already issued (they write the outputs).
          EventPtr copied;
          try {
            stream.copy(ops);
            copied = stream.record(false);
          } catch (...) {
            stream.synchronize_noexcept();  // copies queued before the failure land first
            throw;
          }
          chained->set(copied);
          file_slot_reads_[s] = std::move(copied);
          if (last) chained->finish();
        } catch (const std::exception& e) {
          chained->fail("copying " + file->path + ": " + e.what());
          throw;  // a copy-stream failure: sticky, the next engine call raises it
        }
      });
    }
  } catch (...) {
    io.synchronize();  // tasks already queued write `out`: they run before it dies
    throw;
  }
  chained->issued_by(io.record());

  // The outputs are written until `chained` completes. On a GPU they come from the copy
  // stream's pool, which orders their reuse after the copies once the I/O thread queued them.
  Tensors written(out.begin(), out.end());
  HeldTensors held = device.is_cpu() ? hold(std::move(written)) : hold({}, std::move(written));
  {
    Retire r = retiring();
    // Its own stream key: it completes in order with nothing else.
    track_locked(r, nullptr, chained, Dir::kFetch, total, copies, held, chained.get(),
                 /*bounded=*/false);
    ++stats_.fetches;
    ++stats_.file_fetches;
    stats_.output_allocations += out.size();
    if (!device.is_cpu()) stats_.handovers += out.size();
  }
  if (!device.is_cpu()) {
    for (const at::Tensor& t : out) backend_->hand_over(t, device);
  }
  std::vector<Tensors> taken;  // dies on return, after `out` took its references
  if (wait) {
    backend_->current_wait(device, chained);  // raises if a read failed
    device.is_cpu() ? held->take_all(&taken) : held->take_queued(&taken);
  }
  std::shared_ptr<Handoff> handoff = device.is_cpu() ? nullptr : backend_->handoff(out, device);
  return {std::move(out), chained, {held}, std::move(handoff)};
}

}  // namespace offcache
