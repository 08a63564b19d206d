// The disk tier's files: a ChunkSource whose chunks are MAP_SHARED mappings
// of files on local disk, plus the aligned reads and writes that fill them.
//
// A chunk is one file, created in a private folder (mkdtemp, mode 0700) that
// is removed again right away, and unlinked as soon as it is open: no name
// ever outlives the call that made it, so a killed process leaves nothing.
// Its space is reserved up front (posix_fallocate), so "disk full" is reported when
// a block is placed, on the caller's thread, not later by a background write.
// The mapping lets anyone read a disk-backed tensor's bytes directly (the
// page cache serves them); the engine's own copies use pread/pwrite on an
// O_DIRECT descriptor when the file system accepts one, else a buffered one.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "arena.h"

namespace offcache {

// O_DIRECT needs buffers, offsets and lengths aligned to the logical block
// size; 4096 covers every common device.
constexpr size_t kDiskAlign = 4096;

class DiskSource : public ChunkSource {
 public:
  explicit DiskSource(std::string dir) : dir_(std::move(dir)) {}
  ~DiskSource() override;
  // `error` names the folder, the bytes and the reason (errno text).
  void* allocate(size_t bytes, std::string* error) override;
  void release(void* ptr, size_t bytes) noexcept override;
  bool pinned() const override { return false; }

  // Where the byte at `p` (inside a chunk) lives. `direct` is -1 when the
  // file system refused O_DIRECT.
  struct Where {
    int fd = -1, direct = -1;
    off_t offset = 0;
  };
  Where locate(const void* p) const;
  const std::string& dir() const { return dir_; }
  size_t files() const;

 private:
  struct File {
    size_t size;
    int fd, direct;
  };
  std::string dir_;
  mutable std::mutex mu_;              // chunks are made and looked up from several threads
  std::map<const char*, File> files_;  // mapping base -> its file
};

// Reads or writes exactly `bytes` at `offset`, retrying short transfers and
// EINTR. Uses `w.direct` when buffer, offset and length are aligned, else
// (or if the direct call fails with EINVAL) `w.fd`. False with `error` set
// (bytes, offset, errno text) on failure. `buffered`: set when an aligned
// transfer could not use O_DIRECT.
bool disk_write(const DiskSource::Where& w, const void* buf, size_t bytes, std::string* error,
                bool* buffered = nullptr);
// A read may ask for more than the file holds (an aligned length past its end):
// it succeeds once `need` bytes (default: all of them) are in.
bool disk_read(const DiskSource::Where& w, void* buf, size_t bytes, std::string* error,
               bool* buffered = nullptr, size_t need = SIZE_MAX);

// Reads [offset, offset + bytes) through the page cache only if it is there
// already (preadv2 RWF_NOWAIT on the buffered descriptor): true once `need`
// bytes are in. False, with nothing reported, when some are not cached (the
// caller reads from the disk then, O_DIRECT: a checkpoint larger than RAM
// does not evict the page cache) or the kernel has no RWF_NOWAIT.
// Where cachestat(2) answers (Linux 6.5+), pages that are not all cached are
// reported without a read: the probe of a cold file starts no readahead.
bool read_if_cached(const DiskSource::Where& w, void* buf, size_t bytes, size_t need);
// Whether cachestat(2) answers here (read_if_cached's probe then reads nothing).
bool page_cache_stat_available();

// A regular file opened for reading: buffered, and O_DIRECT where the file
// system allows it (`direct` is -1 where it does not). Closed when the last
// owner lets go, so queued reads keep it open.
struct ReadOnlyFile {
  // Null with `error` set (path, errno text) when it cannot be opened or is not a regular file.
  static std::shared_ptr<ReadOnlyFile> open(const std::string& path, std::string* error);
  ReadOnlyFile() = default;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();
  DiskSource::Where at(off_t offset) const { return DiskSource::Where{fd, direct, offset}; }

  std::string path;
  int fd = -1, direct = -1;
  size_t size = 0;  // at open
};

}  // namespace offcache
