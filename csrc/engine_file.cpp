// Engine::fetch_file: tensors read from byte ranges of a file (a checkpoint's
// safetensors shard) straight onto a device, never copying the file.
//
// The file is read in kDiskPiece pieces into a ring of bounce slots (pinned on
// CUDA). The I/O thread reads a piece and then issues that piece's copies on
// the fetch stream itself, so the calling thread never waits for the disk and
// the copy engine copies piece k while the disk reads piece k + 1. A slot is
// read into again only after the copies of its previous piece have completed.
// The call returns a ChainedEvent: complete once the last piece's copies are.
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
// Bounce slots per fetch: 8 pieces of 8 MiB, one bounce chunk.
constexpr size_t kFileRing = 8;

struct Range {
  size_t begin, end, index;  // file bytes [begin, end) of output `index`
};

// One read: file bytes [offset, offset + length), aligned, of which `need` must exist.
struct Piece {
  size_t offset, length, need;
  std::vector<CopyOp> ops;  // filled in once the bounce slot is known
};

}  // namespace

Engine::Fetched Engine::fetch_file(const std::string& path, const std::vector<int64_t>& offsets,
                                   const std::vector<at::Tensor>& likes, c10::Device device,
                                   bool wait) {
  check_streams();
  device = backend_->resolve_device(device);
  TORCH_CHECK_VALUE(offsets.size() == likes.size(), "offcache: fetch_file got ", offsets.size(),
                    " offsets for ", likes.size(), " tensors");
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

  // Spans in file order, merged across small gaps, cut into aligned pieces.
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
  // Each output's bytes, copied from every piece that holds some of them.
  size_t slot_bytes = 0;
  for (const Piece& p : pieces) slot_bytes = std::max(slot_bytes, p.length);
  const size_t ring = std::min(pieces.size(), kFileRing);
  char* bounce = nullptr;
  throttle(total, Dir::kFetch);  // bounded per direction, like fetch
  HostStream& io = io_stream();
  const Block bounce_block = allocate_bounce(ring * slot_bytes, &bounce);
  size_t copies = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    Piece& p = pieces[k];
    const char* slot = bounce + (k % ring) * slot_bytes;
    for (const Range& r : ranges) {
      const size_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.length);
      if (lo >= hi) continue;
      p.ops.push_back(CopyOp{static_cast<char*>(out[r.index].data_ptr()) + (lo - r.begin),
                             slot + (lo - p.offset), hi - lo});
    }
    copies += p.ops.size();
  }

  auto chained = std::make_shared<ChainedEvent>();
  // Per slot, the copies still reading it; only the I/O thread touches this.
  auto reading = std::make_shared<std::vector<EventPtr>>(ring);
  for (size_t k = 0; k < pieces.size(); ++k) {
    const bool last = k + 1 == pieces.size(), reused = k + ring < pieces.size();
    char* slot = bounce + (k % ring) * slot_bytes;
    io.submit([this, &stream, file, chained, reading, slot, last, reused, k, ring,
               piece = std::move(pieces[k])] {
      EventPtr& previous = (*reading)[k % ring];
      if (previous) previous->wait();  // the slot's last copies have read it
      const auto t0 = std::chrono::steady_clock::now();
      std::string why;
      bool buffered = false;
      if (!disk_read(file->at(static_cast<off_t>(piece.offset)), slot, piece.length, &why,
                     &buffered, piece.need)) {
        const std::string what = "reading " + file->path + ": " + why;
        chained->fail(what);
        throw std::runtime_error(what);  // kept by the I/O thread: the next engine call raises it
      }
      file_read_bytes_ += piece.need;
      if (buffered) ++file_buffered_reads_;
      file_read_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - t0)
                           .count();
      if (!piece.ops.empty()) stream.copy(piece.ops);
      if (last) {
        chained->set(stream.record(false));
      } else if (reused) {  // the slot is read into again: note the copies reading it
        previous = stream.record(false);
      }
    });
  }
  chained->issued_by(io.record());

  std::vector<at::Tensor> keepalive(out.begin(), out.end());  // written until `chained`
  std::vector<InFlight> finished;  // destroyed after the lock is released
  {
    auto l = lock();
    finished = reap_locked();
    // Its own stream key: it completes in order with nothing else.
    in_flight_.push_back(
        InFlight{nullptr, chained, total, Dir::kFetch, std::move(keepalive), chained.get()});
    stats_.in_flight_bytes += total;
    in_flight_dir_[static_cast<int>(Dir::kFetch)] += total;
    stats_.h2d_bytes += total;
    stats_.h2d_copies += copies;
    ++stats_.fetches;
    ++stats_.file_fetches;
    deferred_.push(bounce_block, {chained});
    note_peaks_locked();
  }
  if (!device.is_cpu()) {
    for (const at::Tensor& t : out) backend_->hand_over(t, device);
  }
  if (wait) {
    if (!chained->issued()) ++backend_->counters.syncs;  // the caller waits for the disk
    chained->wait_current(device.is_cpu() ? -1 : device.index());
  }
  return {std::move(out), chained};
}

}  // namespace offcache
