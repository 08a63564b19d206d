#include "disk_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace offcache {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

bool aligned(const void* buf, size_t bytes, off_t offset) {
  return reinterpret_cast<uintptr_t>(buf) % kDiskAlign == 0 && bytes % kDiskAlign == 0 &&
         static_cast<size_t>(offset) % kDiskAlign == 0;
}

// A new file with no name: O_TMPFILE where the file system has it (the file
// never has a name); else made in a fresh private folder, unlinked, and the
// folder removed, before this returns. -1 with `error` set on failure.
int anonymous_file(const std::string& dir, std::string* error) {
#ifdef O_TMPFILE
  // Any failure falls back: EOPNOTSUPP (no O_TMPFILE on this file system) and EISDIR (kernel
  // < 3.11) are expected; a real error (the folder's) recurs below, which names it.
  const int tmp = open(dir.c_str(), O_TMPFILE | O_RDWR | O_EXCL | O_CLOEXEC, 0600);
  if (tmp >= 0) return tmp;
#endif
  std::string tmpl = dir + "/offcache-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {  // mode 0700
    *error = "cannot make a private folder in " + dir + ": " + errno_text(errno);
    return -1;
  }
  const std::string folder(buf.data());
  const std::string path = folder + "/chunk";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const int err = errno;
  if (fd >= 0) unlink(path.c_str());
  rmdir(folder.c_str());
  if (fd < 0) *error = "cannot create a file in " + folder + ": " + errno_text(err);
  return fd;
}

}  // namespace

DiskSource::~DiskSource() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [base, f] : files_) {
    munmap(const_cast<char*>(base), f.size);
    close(f.fd);
    if (f.direct >= 0) close(f.direct);
  }
}

void* DiskSource::allocate(size_t bytes, std::string* error) {
  std::string why;
  const int fd = anonymous_file(dir_, &why);
  if (fd < 0) {
    if (error) *error = why;
    return nullptr;
  }
  // Reserve the space now: ENOSPC / EFBIG (RLIMIT_FSIZE) surface here. Where
  // the file system has no fallocate (ext2, say) posix_fallocate writes every
  // block instead: a file that is only truncated has no space behind it, and a
  // later write through the mapping would fault (SIGBUS) when the disk fills.
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    const int err = rc;  // posix_fallocate returns the error, errno is unset
    close(fd);
    if (error) {
      *error =
          "no room for " + std::to_string(bytes) + " bytes in " + dir_ + ": " + errno_text(err);
    }
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    if (error) {
      *error = "mmap of a " + std::to_string(bytes) + "-byte file in " + dir_ +
               " failed: " + errno_text(err);
    }
    return nullptr;
  }
  // The same file again, unbuffered, through its /proc link (it has no name).
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const int direct = open(link.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  std::lock_guard<std::mutex> lock(mu_);
  files_[static_cast<const char*>(p)] = File{bytes, fd, direct};
  return p;
}

void DiskSource::release(void* ptr, size_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(static_cast<const char*>(ptr));
  if (it == files_.end()) return;
  munmap(ptr, bytes);
  close(it->second.fd);
  if (it->second.direct >= 0) close(it->second.direct);
  files_.erase(it);
}

DiskSource::Where DiskSource::locate(const void* p) const {
  const auto* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.upper_bound(c);
  if (it == files_.begin()) return {};
  --it;
  if (c >= it->first + it->second.size) return {};
  return Where{it->second.fd, it->second.direct, static_cast<off_t>(c - it->first)};
}

size_t DiskSource::files() const {
  std::lock_guard<std::mutex> lock(mu_);
  return files_.size();
}

namespace {

template <class Op>
bool transfer(const DiskSource::Where& w, char* buf, size_t bytes, const char* what, Op op,
              std::string* error, bool* buffered, size_t need) {
  int fd = w.direct >= 0 && aligned(buf, bytes, w.offset) ? w.direct : w.fd;
  if (buffered) *buffered = fd != w.direct && aligned(buf, bytes, w.offset);
  size_t done = 0;
  need = std::min(need, bytes);
  while (done < need) {
    const ssize_t n = op(fd, buf + done, bytes - done, w.offset + static_cast<off_t>(done));
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL && fd == w.direct) {  // O_DIRECT refused after all
      fd = w.fd;
      if (buffered) *buffered = true;
      continue;
    }
    const int err = n == 0 ? EIO : errno;
    if (error) {
      *error = std::string(what) + " of " + std::to_string(bytes) + " bytes at offset " +
               std::to_string(w.offset) + " failed after " + std::to_string(done) +
               " bytes: " + (n == 0 ? std::string("unexpected end of file") : errno_text(err));
    }
    return false;
  }
  return true;
}

}  // namespace

bool disk_write(const DiskSource::Where& w, const void* buf, size_t bytes, std::string* error,
                bool* buffered) {
  return transfer(
      w, const_cast<char*>(static_cast<const char*>(buf)), bytes, "write",
      [](int fd, char* p, size_t n, off_t o) { return pwrite(fd, p, n, o); }, error, buffered,
      bytes);
}

bool disk_read(const DiskSource::Where& w, void* buf, size_t bytes, std::string* error,
               bool* buffered, size_t need) {
  return transfer(
      w, static_cast<char*>(buf), bytes, "read",
      [](int fd, char* p, size_t n, off_t o) { return pread(fd, p, n, o); }, error, buffered, need);
}

namespace {

#ifdef SYS_cachestat
constexpr long kCachestat = SYS_cachestat;
#else
constexpr long kCachestat = 451;  // cachestat(2), Linux 6.5+: one number on every architecture
#endif

// cachestat(2)'s argument and result (linux/mman.h, which older headers lack).
struct CachestatRange {
  uint64_t off, len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

std::atomic<bool> g_no_cachestat{false};  // set once the kernel (or a seccomp filter) refuses it

// Whether every page of [offset, offset + bytes) is in the page cache: 1 yes, 0 no, -1 unknown
// (no cachestat). Reads nothing and starts no readahead.
int all_cached(int fd, off_t offset, size_t bytes) {
  if (bytes == 0) return 1;
  if (g_no_cachestat.load(std::memory_order_relaxed)) return -1;
  CachestatRange range{static_cast<uint64_t>(offset), bytes};
  Cachestat st{};
  if (syscall(kCachestat, fd, &range, &st, 0) != 0) {
    if (errno == ENOSYS || errno == EPERM) g_no_cachestat.store(true, std::memory_order_relaxed);
    return -1;  // EOPNOTSUPP (e.g. hugetlbfs), EBADF, ...: the RWF_NOWAIT probe decides
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t first = static_cast<uint64_t>(offset) / page;
  const uint64_t last = (static_cast<uint64_t>(offset) + bytes - 1) / page;
  return st.nr_cache >= last - first + 1 ? 1 : 0;
}

}  // namespace

bool page_cache_stat_available() {
  if (g_no_cachestat.load(std::memory_order_relaxed)) return false;
  CachestatRange range{0, 0};
  Cachestat st{};
  const int fd = ::open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = syscall(kCachestat, fd, &range, &st, 0) == 0;
  ::close(fd);
  return ok;
}

bool read_if_cached(const DiskSource::Where& w, void* buf, size_t bytes, size_t need) {
  need = std::min(need, bytes);
  // A RWF_NOWAIT read of pages that are not cached fails, but starts a readahead of them first: a
  // cold checkpoint would be read from the disk twice (this probe's readahead, then O_DIRECT).
  // cachestat asks without reading; the RWF_NOWAIT read then only runs where every page is there.
  if (all_cached(w.fd, w.offset, need) == 0) return false;
  size_t done = 0;
  while (done < need) {
    iovec v{static_cast<char*>(buf) + done, bytes - done};
    const ssize_t n = preadv2(w.fd, &v, 1, w.offset + static_cast<off_t>(done), RWF_NOWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return false;  // EAGAIN (not cached), EOF, EOPNOTSUPP (no RWF_NOWAIT) or an error
    }
  }
  return true;
}

std::shared_ptr<ReadOnlyFile> ReadOnlyFile::open(const std::string& path, std::string* error) {
  auto f = std::make_shared<ReadOnlyFile>();
  f->path = path;
  // O_NONBLOCK: a FIFO without a writer must not block the open (reads of regular files ignore it).
  f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  struct stat st {};
  if (f->fd < 0 || fstat(f->fd, &st) != 0) {
    if (error) *error = "cannot open " + path + ": " + errno_text(errno);
    return nullptr;
  }
  if (!S_ISREG(st.st_mode)) {
    if (error) *error = "cannot read " + path + ": not a regular file";
    return nullptr;
  }
  f->size = static_cast<size_t>(st.st_size);
  // Page-cache coherence is the kernel's: O_DIRECT reads see what buffered writes left.
  f->direct = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  return f;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd >= 0) close(fd);
  if (direct >= 0) close(direct);
}

}  // namespace offcache
