// The disk tier's files: no name left behind, reserved space, aligned and
// unaligned I/O, and clear errors.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "arena.h"
#include "disk_file.h"

namespace offcache {
namespace {

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/offcache-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { rmdir(path.c_str()); }
  size_t entries() const {
    size_t n = 0;
    DIR* d = opendir(path.c_str());
    while (dirent* e = readdir(d)) n += std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..");
    closedir(d);
    return n;
  }
};

TEST(DiskSource, ChunksAreMappedFilesWithNoName) {
  TempDir dir;
  DiskSource source(dir.path);
  std::string why;
  auto* p = static_cast<char*>(source.allocate(1 << 20, &why));
  ASSERT_NE(p, nullptr) << why;
  EXPECT_EQ(dir.entries(), 0u);  // unlinked, private folder removed
  EXPECT_EQ(source.files(), 1u);
  std::memset(p, 7, 1 << 20);  // the mapping is ordinary memory
  DiskSource::Where w = source.locate(p + 8192);
  EXPECT_GE(w.fd, 0);
  EXPECT_EQ(w.offset, 8192);
  EXPECT_LT(source.locate(p + (1 << 20)).fd, 0);
  source.release(p, 1 << 20);
  EXPECT_EQ(source.files(), 0u);
}

TEST(DiskSource, AlignedAndUnalignedIoSeeTheMapping) {
  TempDir dir;
  DiskSource source(dir.path);
  std::string why;
  const size_t n = 4 * kDiskAlign;
  auto* p = static_cast<char*>(source.allocate(n, &why));
  ASSERT_NE(p, nullptr) << why;
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, kDiskAlign, n), 0);
  auto* buf = static_cast<char*>(aligned);
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<char>(i * 31);
  ASSERT_TRUE(disk_write(source.locate(p), buf, n, &why)) << why;  // O_DIRECT where allowed
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(p[i], buf[i]) << i;
  // Unaligned: buffered descriptor.
  ASSERT_TRUE(disk_write(source.locate(p + 3), "hello", 5, &why)) << why;
  EXPECT_EQ(std::memcmp(p + 3, "hello", 5), 0);
  std::vector<char> back(n);
  ASSERT_TRUE(disk_read(source.locate(p + 1), back.data() + 1, n - 1, &why)) << why;
  EXPECT_EQ(std::memcmp(back.data() + 1, p + 1, n - 1), 0);
  free(aligned);
  source.release(p, n);
}

TEST(DiskSource, MissingFolderNamesIt) {
  DiskSource source("/nonexistent/offcache-dir");
  std::string why;
  EXPECT_EQ(source.allocate(4096, &why), nullptr);
  EXPECT_NE(why.find("/nonexistent/offcache-dir"), std::string::npos) << why;
}

TEST(DiskSource, FileSizeLimitIsAClearError) {
  TempDir dir;
  // In a child: RLIMIT_FSIZE makes the reservation fail with EFBIG (SIGXFSZ ignored).
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    setrlimit(RLIMIT_FSIZE, &lim);
    DiskSource source(dir.path);
    std::string why;
    void* p = source.allocate(8 << 20, &why);
    if (write(pipefd[1], why.data(), why.size()) < 0) _exit(3);
    _exit(p == nullptr ? 0 : 2);
  }
  close(pipefd[1]);
  char buf[512] = {};
  const ssize_t got = read(pipefd[0], buf, sizeof(buf) - 1);
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  const std::string why(buf, got > 0 ? got : 0);
  EXPECT_NE(why.find(dir.path), std::string::npos) << why;
  EXPECT_NE(why.find("8388608 bytes"), std::string::npos) << why;
  EXPECT_EQ(dir.entries(), 0u);
}

TEST(DiskSource, ArenaOverDiskChunks) {
  TempDir dir;
  DiskSource source(dir.path);
  ArenaOptions options;
  options.min_chunk = 1 << 20;
  options.alignment = kDiskAlign;
  Arena arena(source, options);
  auto a = arena.allocate(5000);
  auto b = arena.allocate(100);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->ptr) % kDiskAlign, 0u);
  EXPECT_EQ(source.locate(b->ptr).offset % kDiskAlign, 0);
  arena.free(*a);
  arena.free(*b);
}

// Writes `n` bytes (byte i: i * mul + 1) to a new file at `path`, synced; returns them
// (empty on failure).
std::vector<char> write_file(const std::string& path, size_t n, int mul) {
  std::vector<char> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * mul + 1);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return {};
  const bool ok =
      std::fwrite(data.data(), 1, n, f) == n && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  std::fclose(f);
  return ok ? data : std::vector<char>{};
}

// The checkpoint reader: any regular file, reads past its end allowed up to
// `need`, and clear errors.
TEST(ReadOnlyFile, ReadsAlignedPiecesPastTheEndUpToWhatIsNeeded) {
  TempDir dir;
  const std::string path = dir.path + "/weights.bin";
  const size_t n = 3 * kDiskAlign + 100;  // not a multiple of the alignment
  const std::vector<char> data = write_file(path, n, 7);
  ASSERT_EQ(data.size(), n);
  std::string why;
  auto file = ReadOnlyFile::open(path, &why);
  ASSERT_NE(file, nullptr) << why;
  EXPECT_EQ(file->size, n);
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, kDiskAlign, 4 * kDiskAlign), 0);
  auto* buf = static_cast<char*>(aligned);
  // The last aligned piece: 4096 bytes asked, 100 + 4096 there past offset 2 * 4096.
  ASSERT_TRUE(
      disk_read(file->at(2 * kDiskAlign), buf, 2 * kDiskAlign, &why, nullptr, kDiskAlign + 100))
      << why;
  EXPECT_EQ(std::memcmp(buf, data.data() + 2 * kDiskAlign, kDiskAlign + 100), 0);
  // More needed than the file holds: an error naming the end of file, not a short read.
  EXPECT_FALSE(
      disk_read(file->at(2 * kDiskAlign), buf, 2 * kDiskAlign, &why, nullptr, kDiskAlign + 101));
  EXPECT_NE(why.find("unexpected end of file"), std::string::npos) << why;
  free(aligned);
  file.reset();
  unlink(path.c_str());
}

TEST(ReadOnlyFile, MissingFilesAndFoldersAreClearErrors) {
  TempDir dir;
  std::string why;
  EXPECT_EQ(ReadOnlyFile::open(dir.path + "/missing.safetensors", &why), nullptr);
  EXPECT_NE(why.find(dir.path + "/missing.safetensors"), std::string::npos) << why;
  EXPECT_NE(why.find("No such file"), std::string::npos) << why;
  EXPECT_EQ(ReadOnlyFile::open(dir.path, &why), nullptr);
  EXPECT_NE(why.find("not a regular file"), std::string::npos) << why;
}

// Pages of the first `n` bytes of `fd` in the page cache (mincore of a mapping); `n` where it
// cannot map.
size_t resident_pages_of(int fd, size_t n) {
  void* map = mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
  EXPECT_NE(map, MAP_FAILED);
  if (map == MAP_FAILED) return n;
  std::vector<unsigned char> resident(n / kDiskAlign);
  EXPECT_EQ(mincore(map, n, resident.data()), 0);
  munmap(map, n);
  size_t count = 0;
  for (unsigned char r : resident) count += r & 1;
  return count;
}

// Checkpoints in the page cache are read from it; dropped ones are left to O_DIRECT.
TEST(ReadOnlyFile, ReadIfCachedServesOnlyResidentPages) {
  TempDir dir;
  const std::string path = dir.path + "/cached.bin";
  const size_t n = 64 * kDiskAlign;
  const std::vector<char> data =
      write_file(path, n, 13);  // synced: clean pages the kernel may drop
  ASSERT_EQ(data.size(), n);
  std::string why;
  auto file = ReadOnlyFile::open(path, &why);
  ASSERT_NE(file, nullptr) << why;
  std::vector<char> back(n);
  ASSERT_TRUE(read_if_cached(file->at(0), back.data(), n, n));  // just written: cached
  EXPECT_EQ(std::memcmp(back.data(), data.data(), n), 0);
  EXPECT_FALSE(read_if_cached(file->at(0), back.data(), n + 100, n + 1));  // past the end
  // Dropped from the page cache (where the file system lets fadvise drop it): not served.
  // The kernel may bring pages back between the drop and the read (readahead, memory
  // pressure elsewhere): a few rounds, one of which must see them dropped and not served.
  const auto resident_pages = [&] { return resident_pages_of(file->fd, n); };
  bool dropped = false, refused = false;
  for (int round = 0; round < 5 && !refused; ++round) {
    posix_fadvise(file->fd, 0, 0, POSIX_FADV_DONTNEED);
    if (resident_pages() != 0) continue;
    dropped = true;
    refused = !read_if_cached(file->at(0), back.data(), n, n);
  }
  if (!dropped) GTEST_SKIP() << "this file system keeps the pages (tmpfs?)";
  EXPECT_TRUE(refused) << "read_if_cached served pages that were not in the page cache";
  ASSERT_TRUE(disk_read(file->at(0), back.data(), n, &why)) << why;  // the disk path still reads it
  EXPECT_EQ(std::memcmp(back.data(), data.data(), n), 0);
  file.reset();
  unlink(path.c_str());
}

// The probe of a dropped file reads nothing: the O_DIRECT read that follows is the disk's only one
// (a RWF_NOWAIT read would fail, but start a readahead of the pages first).
TEST(ReadOnlyFile, ReadIfCachedOfDroppedPagesStartsNoRead) {
  if (!page_cache_stat_available())
    GTEST_SKIP() << "no cachestat(2) here (Linux < 6.5, or filtered)";
  TempDir dir;
  const std::string path = dir.path + "/cold.bin";
  const size_t n = 256 * kDiskAlign;
  ASSERT_EQ(write_file(path, n, 7).size(), n);
  std::string why;
  auto file = ReadOnlyFile::open(path, &why);
  ASSERT_NE(file, nullptr) << why;
  const auto resident_pages = [&] { return resident_pages_of(file->fd, n); };
  std::vector<char> back(n);
  bool dropped = false;
  for (int round = 0; round < 5 && !dropped; ++round) {
    posix_fadvise(file->fd, 0, 0, POSIX_FADV_DONTNEED);
    dropped = resident_pages() == 0;
  }
  if (!dropped) GTEST_SKIP() << "this file system keeps the pages (tmpfs?)";
  EXPECT_FALSE(read_if_cached(file->at(0), back.data(), n, n));
  usleep(200 * 1000);  // a readahead the probe had started would have landed by now
  EXPECT_EQ(resident_pages(), 0u) << "the probe of a dropped file read pages into the page cache";
  file.reset();
  unlink(path.c_str());
}

}  // namespace
}  // namespace offcache
