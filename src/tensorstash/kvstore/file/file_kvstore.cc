// FileKvStore: one key is one file under the root directory.
//
// Atomic write protocol. Write(key, value) does
//   1. create "<key>.tmp.<random>" in the key's directory with O_CREAT | O_EXCL (two writers never
//      share a temporary file, and an existing file is never reused);
//   2. write every byte and fsync it, so the contents reach the disk before the name does;
//   3. rename(2) it onto "<key>", which atomically replaces the directory entry: readers see the
//      old object or the new one, and so does the store after a crash;
//   4. fsync the parent directory, which makes the rename itself durable.
// Step 4 is left to Sync(key) (which also repeats the now cheap fsync of the file): a caller that
// writes many objects into one directory then pays for one directory fsync, not one per object.
// If any step fails, the temporary file is removed. One left behind by a crash is an ordinary
// file to List() and is removed with its directory by DeletePrefix().
//
// OpenForWrite() writes in place (O_CREAT | O_TRUNC): chunked data is written by many threads at
// once and then made durable with WritableFile::Sync() and Sync(key). The engine commits a step
// by writing its commit record last, so an object torn by a crash is never referenced.
//
// Path resolution. All paths are resolved relative to the root's descriptor and never through a
// symlink, so a link planted inside the store cannot redirect a read or write outside it. Where
// the kernel has openat2(2) (Linux 5.6+), one call with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS does
// this; otherwise the path is walked one directory at a time with O_NOFOLLOW. Operations that
// act on a name (rename, unlink, mkdir) open the key's parent directory that way and then use
// the *at() call on the last segment, which they never follow either. Either way a symlink gives
// ELOOP, which becomes FailedPrecondition.
//
// I/O. pread/pwrite are looped: they may be interrupted (EINTR) or move fewer bytes than asked
// (Linux moves at most ~2 GiB per call). Every descriptor is O_CLOEXEC so that a fork+exec in
// another thread cannot inherit it.
#include "tensorstash/kvstore/file/file_kvstore.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tensorstash/kvstore/folder_view.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/util/staging_buffer.h"

#if __has_include(<linux/openat2.h>) && defined(SYS_openat2) && \
    !defined(TS_FILE_KVSTORE_DISABLE_OPENAT2)
#include <linux/openat2.h>
// Defining TS_FILE_KVSTORE_DISABLE_OPENAT2 forces the walking fallback, so that it can be tested
// on kernels that have openat2.
#define TS_FILE_KVSTORE_HAVE_OPENAT2 1
#endif

namespace tensorstash {
namespace {

// Linux moves at most 0x7ffff000 bytes per read/write call; asking for no more than 1 GiB keeps
// each call well inside that and inside ssize_t everywhere.
constexpr size_t kMaxIoChunk = size_t{1} << 30;
constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<off_t>::max());
// Opening for reading: a fifo planted in the store must not block the open (it then fails the
// regular-file check); regular files ignore O_NONBLOCK.
constexpr int kReadFlags = O_RDONLY | O_NONBLOCK;
// A temporary name adds ".tmp." and 16 hex digits to the key's last segment.
constexpr size_t kTempSuffixLength = 5 + 16;
constexpr size_t kMaxNameLength = 255;

template <typename Fn>
auto RetryOnEintr(Fn fn) {
  decltype(fn()) result;
  do {
    result = fn();
  } while (result == -1 && errno == EINTR);
  return result;
}

// Owns a file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset() {
    // The error is dropped: descriptors whose close can report lost data go through CloseFd.
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Returns 0 or an errno. Linux releases the descriptor even when close fails (EINTR included),
// so it is never retried; EIO/ENOSPC here mean written data was lost and must be reported.
int CloseFd(UniqueFd& fd) {
  const int raw = fd.Release();
  if (raw < 0) return 0;
  if (::close(raw) == 0 || errno == EINTR) return 0;
  return errno;
}

// A descriptor, or the errno that prevented opening it. The low-level helpers return errno
// rather than Status because callers react to particular values (ENOENT: create the parents).
struct OpenResult {
  UniqueFd fd;
  int error = 0;
};

OpenResult FromRaw(int raw) {
  if (raw < 0) return {UniqueFd(), errno};
  return {UniqueFd(raw), 0};
}

#ifdef TS_FILE_KVSTORE_HAVE_OPENAT2
// Whether openat2 works here. A kernel older than 5.6 says ENOSYS; some container sandboxes say
// EPERM. Probing once, on a path that must open, tells the two apart from real errors later.
bool Openat2Works() {
  static const bool works = [] {
    open_how how{};
    how.flags = O_PATH | O_CLOEXEC | O_DIRECTORY;
    how.resolve = RESOLVE_NO_MAGICLINKS;
    const long fd = syscall(SYS_openat2, AT_FDCWD, "/", &how, sizeof(how));
    if (fd < 0) return false;
    ::close(static_cast<int>(fd));
    return true;
  }();
  return works;
}
#endif

// Opens `name`, a direct child of `parent`, as an O_PATH descriptor if it is a real directory:
// O_PATH | O_NOFOLLOW opens a symlink itself rather than its target, and fstat tells which it
// is. ELOOP for a symlink, ENOTDIR for anything else that is not a directory.
OpenResult OpenSubdirectory(int parent, const std::string& name) {
  UniqueFd fd(RetryOnEintr(
      [&] { return ::openat(parent, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC); }));
  if (!fd.valid()) return {UniqueFd(), errno};
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return {UniqueFd(), errno};
  if (S_ISLNK(st.st_mode)) return {UniqueFd(), ELOOP};
  if (!S_ISDIR(st.st_mode)) return {UniqueFd(), ENOTDIR};
  return {std::move(fd), 0};
}

// Opens `rel` ("" = the root) beneath `root_fd` without following any symlink on the way.
OpenResult OpenBeneath(int root_fd, std::string_view rel, int flags, mode_t mode = 0) {
  flags |= O_CLOEXEC | O_NOFOLLOW;
  if (rel.empty()) rel = ".";
#ifdef TS_FILE_KVSTORE_HAVE_OPENAT2
  if (Openat2Works()) {
    const std::string path(rel);
    open_how how{};
    how.flags = static_cast<uint64_t>(flags);
    // openat2 rejects a mode without O_CREAT (EINVAL), unlike openat.
    how.mode = (flags & O_CREAT) != 0 ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    const long fd = RetryOnEintr(
        [&] { return syscall(SYS_openat2, root_fd, path.c_str(), &how, sizeof(how)); });
    if (fd < 0) return {UniqueFd(), errno};
    return {UniqueFd(static_cast<int>(fd)), 0};
  }
#endif
  // Walk the directories one at a time, refusing symlinks (OpenSubdirectory).
  UniqueFd dir;
  int current = root_fd;
  size_t start = 0;
  for (size_t slash; (slash = rel.find('/', start)) != std::string_view::npos; start = slash + 1) {
    const std::string segment(rel.substr(start, slash - start));
    OpenResult next = OpenSubdirectory(current, segment);
    if (next.error != 0) return next;
    dir = std::move(next.fd);
    current = dir.get();
  }
  const std::string last(rel.substr(start));
  return FromRaw(RetryOnEintr([&] { return ::openat(current, last.c_str(), flags, mode); }));
}

// Creates the directories of `rel` beneath `root_fd` as needed (mkdir -p that never follows a
// symlink) and returns an O_PATH descriptor of the last one.
OpenResult MakeDirectories(int root_fd, std::string_view rel) {
  UniqueFd dir;
  int current = root_fd;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string_view::npos) end = rel.size();
    const std::string segment(rel.substr(start, end - start));
    // EEXIST is the common case: another writer, or an earlier key, made it already.
    if (::mkdirat(current, segment.c_str(), 0777) != 0 && errno != EEXIST) {
      return {UniqueFd(), errno};
    }
    OpenResult next = OpenSubdirectory(current, segment);
    if (next.error != 0) return next;
    dir = std::move(next.fd);
    current = dir.get();
    start = end + 1;
  }
  return {std::move(dir), 0};
}

// Writes all of `size` bytes at `offset`. Returns 0 or an errno.
int PwriteFully(int fd, const char* data, size_t size, uint64_t offset) {
  if (size > 0 && (offset > kMaxOffset || size > kMaxOffset - offset)) return EFBIG;
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, std::min(size, kMaxIoChunk), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    // No progress and no error: retrying would spin forever.
    if (n == 0) return EIO;
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return 0;
}

// Reads up to `size` bytes at `offset`, stopping early only at end of file.
struct PreadResult {
  size_t done = 0;
  int error = 0;
};
PreadResult PreadFully(int fd, char* dest, size_t size, uint64_t offset) {
  PreadResult result;
  // Nothing can be stored past the largest off_t: the range is past the end.
  if (offset > kMaxOffset) return result;
  size = std::min<uint64_t>(size, kMaxOffset - offset);
  while (result.done < size) {
    const ssize_t n = ::pread(fd, dest + result.done, std::min(size - result.done, kMaxIoChunk),
                              static_cast<off_t>(offset + result.done));
    if (n < 0) {
      if (errno == EINTR) continue;
      result.error = errno;
      return result;
    }
    if (n == 0) break;  // End of file.
    result.done += static_cast<size_t>(n);
  }
  return result;
}

int FsyncFd(int fd) {
  return RetryOnEintr([&] { return ::fsync(fd); }) == 0 ? 0 : errno;
}

// ErrnoToStatus, plus the two errors our own path resolution produces.
Status FsError(int error, std::string_view operation, std::string_view path) {
  if (error == ELOOP) {
    return FailedPreconditionError(
        StrCat(operation, " '", path, "' failed: refusing to follow a symlink inside the store"));
  }
  if (error == EXDEV) {
    return FailedPreconditionError(
        StrCat(operation, " '", path, "' failed: path leaves the store root"));
  }
  return ErrnoToStatus(error, operation, path);
}

Status NotAnObject(std::string_view operation, std::string_view path) {
  return NotAnObjectError(operation, path);
}

Status UnderAnObject(std::string_view operation, std::string_view path) {
  return FailedPreconditionError(
      StrCat(operation, " '", path, "' failed: a parent of the key is an object, not a directory"));
}

Status IsADirectory(std::string_view operation, std::string_view path) {
  return FailedPreconditionError(
      StrCat(operation, " '", path, "' failed: a directory of that name exists"));
}

// OK for a regular file; NotFound for a directory (a "directory" key is not an object), and
// FailedPrecondition for anything else (fifo, device, socket).
Status CheckIsObject(const struct stat& st, std::string_view operation, std::string_view path) {
  if (S_ISREG(st.st_mode)) return OkStatus();
  if (S_ISDIR(st.st_mode)) return NotAnObject(operation, path);
  return FailedPreconditionError(StrCat(operation, " '", path, "' failed: not a regular file"));
}

Status Truncated(std::string_view path, uint64_t offset, size_t size, uint64_t object_size) {
  return DataLossError(StrCat("read of '", path, "' truncated: wanted ", size, " bytes at offset ",
                              offset, ", object has ", object_size, " bytes"));
}

uint64_t RandomU64() {
  thread_local uint64_t state = [] {
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof(seed), GRND_NONBLOCK) != static_cast<ssize_t>(sizeof(seed))) {
      // No entropy yet: time and thread still make collisions unlikely, and O_EXCL makes them
      // harmless.
      seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
             std::hash<std::thread::id>{}(std::this_thread::get_id());
    }
    return seed;
  }();
  // splitmix64. The pid is mixed in at each call because a forked child inherits `state`.
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL) ^ (static_cast<uint64_t>(::getpid()) << 40);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Sixteen lowercase hex digits.
std::string HexU64(uint64_t value) {
  char buffer[17];
  std::snprintf(buffer, sizeof(buffer), "%016llx", static_cast<unsigned long long>(value));
  return buffer;
}

// A key's parent directory, open, and its last segment.
struct ParentDir {
  UniqueFd owned;  // Not valid when the parent is the root itself.
  int fd = -1;
  std::string name;
};

// Splits "a/b/c" into "a/b" and "c" ("" and "c" for a top-level key).
std::pair<std::string_view, std::string_view> SplitKey(std::string_view key) {
  const size_t slash = key.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), key};
  return {key.substr(0, slash), key.substr(slash + 1)};
}

// Opens the parent directory of `key` with `dir_flags` (O_PATH for *at() calls, O_RDONLY to
// fsync it). With `create`, missing directories are made; an object in the way is then
// FailedPrecondition. Without it, a missing parent is NotFound.
Result<ParentDir> OpenParent(int root_fd, std::string_view key, int dir_flags, bool create,
                             std::string_view operation, std::string_view path) {
  const auto [dir, name] = SplitKey(key);
  ParentDir parent;
  parent.name = std::string(name);
  if (dir.empty()) {
    parent.fd = root_fd;
    return parent;
  }
  OpenResult opened = OpenBeneath(root_fd, dir, dir_flags | O_DIRECTORY);
  if (opened.error == ENOENT && create) opened = MakeDirectories(root_fd, dir);
  if (opened.error != 0) {
    if (opened.error == ENOTDIR && create) return UnderAnObject(operation, path);
    return FsError(opened.error, operation, path);
  }
  parent.owned = std::move(opened.fd);
  parent.fd = parent.owned.get();
  return parent;
}

// A directory stream that owns its descriptor.
struct DirCloser {
  void operator()(DIR* dir) const { ::closedir(dir); }
};
using DirStream = std::unique_ptr<DIR, DirCloser>;

struct DirEntry {
  std::string name;
  unsigned char type;  // DT_REG, DT_DIR, ...; never DT_UNKNOWN.
};

// Reads every entry of the directory `fd` (taking ownership) except "." and "..". Entries that
// vanish while being read are dropped. Returns 0 or an errno; `stream` stays open for *at().
int ReadDirectory(UniqueFd fd, DirStream* stream, std::vector<DirEntry>* entries) {
  DIR* dir = ::fdopendir(fd.get());
  if (dir == nullptr) return errno;
  fd.Release();
  stream->reset(dir);
  while (true) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) return errno;
    const std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    unsigned char type = entry->d_type;
    if (type == DT_UNKNOWN) {
      // Some filesystems leave d_type unset; ask, without following a symlink.
      struct stat st;
      if (::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;
        return errno;
      }
      if (S_ISREG(st.st_mode)) {
        type = DT_REG;
      } else if (S_ISDIR(st.st_mode)) {
        type = DT_DIR;
      } else {
        type = DT_LNK;  // Symlinks and special files alike: callers skip or unlink them.
      }
    }
    entries->push_back({std::string(name), type});
  }
}

// Appends "<key_base><name>" for every regular file below the directory `fd` whose first-level
// name starts with `name_filter`. Symlinks and special files are skipped; entries removed while
// walking are ignored.
Status ListTree(UniqueFd fd, const std::string& key_base, std::string_view name_filter,
                const std::string& path, std::vector<std::string>* keys) {
  DirStream stream;
  std::vector<DirEntry> entries;
  if (int error = ReadDirectory(std::move(fd), &stream, &entries); error != 0) {
    return FsError(error, "list", path);
  }
  for (const DirEntry& entry : entries) {
    if (!entry.name.starts_with(name_filter)) continue;
    if (entry.type == DT_REG) {
      keys->push_back(key_base + entry.name);
    } else if (entry.type == DT_DIR) {
      UniqueFd child(RetryOnEintr([&] {
        return ::openat(::dirfd(stream.get()), entry.name.c_str(),
                        O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      }));
      if (!child.valid()) {
        // Removed or replaced (by a symlink or a file) since it was read: nothing to list.
        if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP) continue;
        return FsError(errno, "list", path + "/" + entry.name);
      }
      TS_RETURN_IF_ERROR(ListTree(std::move(child), key_base + entry.name + "/", "",
                                  path + "/" + entry.name, keys));
    }
  }
  return OkStatus();
}

Status RemoveTree(int parent_fd, const std::string& name, const std::string& path,
                  bool directory_only);

// Removes `name` from the directory `dir_fd`: unlinks a file or symlink (never its target),
// removes a directory with its contents. Missing is OK.
Status RemoveEntry(int dir_fd, const std::string& name, const std::string& path) {
  if (::unlinkat(dir_fd, name.c_str(), 0) == 0 || errno == ENOENT) return OkStatus();
  if (errno == EISDIR) return RemoveTree(dir_fd, name, path, /*directory_only=*/false);
  return FsError(errno, "delete", path);
}

// Removes everything inside the directory `fd` (taking ownership), but not the directory.
Status RemoveContents(UniqueFd fd, const std::string& path) {
  DirStream stream;
  std::vector<DirEntry> entries;
  if (int error = ReadDirectory(std::move(fd), &stream, &entries); error != 0) {
    return FsError(error, "delete prefix (read directory)", path);
  }
  for (const DirEntry& entry : entries) {
    TS_RETURN_IF_ERROR(RemoveEntry(::dirfd(stream.get()), entry.name, path + "/" + entry.name));
  }
  return OkStatus();
}

// Removes the directory `name` of `parent_fd` and everything in it. Missing is OK. When
// `name` is not a directory: with `directory_only` nothing is under it, so nothing is removed
// (a symlink is FailedPrecondition); without, it is unlinked (it was replaced meanwhile).
Status RemoveTree(int parent_fd, const std::string& name, const std::string& path,
                  bool directory_only) {
  UniqueFd dir(RetryOnEintr([&] {
    return ::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  }));
  if (!dir.valid()) {
    if (errno == ENOENT) return OkStatus();
    if (!directory_only && (errno == ENOTDIR || errno == ELOOP)) {
      return RemoveEntry(parent_fd, name, path);
    }
    if (errno == ENOTDIR) return OkStatus();
    return FsError(errno, "delete prefix (open directory)", path);
  }
  TS_RETURN_IF_ERROR(RemoveContents(std::move(dir), path));
  if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) == 0 || errno == ENOENT) {
    return OkStatus();
  }
  if (errno == ENOTEMPTY || errno == EEXIST) {
    return FailedPreconditionError(
        StrCat("delete prefix '", path,
               "' failed: directory not empty after deleting its contents "
               "(written to concurrently?)"));
  }
  return FsError(errno, "delete prefix (remove directory)", path);
}

// Reads the open object `fd` whole.
Result<std::string> ReadWhole(int fd, std::string_view path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return FsError(errno, "read", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "read", path));
  std::string value(static_cast<size_t>(st.st_size), '\0');
  const PreadResult read = PreadFully(fd, value.data(), value.size(), 0);
  if (read.error != 0) return FsError(read.error, "read", path);
  // Shorter only if an in-place writer truncated it meanwhile; return what is there.
  value.resize(read.done);
  return value;
}

// Direct writes (WritableFile::PreferDirectWrites). A second descriptor of the file, opened with
// O_DIRECT through /proc/self/fd (a new open file description, so the first stays buffered),
// writes the whole 4 KiB blocks of each large write, which then never pass through the page
// cache. Filling fresh page-cache memory was the costliest part of a synced save on a VM whose
// host reclaims free memory: writing 1 GiB took 190 ms into memory the kernel had just freed and
// about 1000 ms into memory the host had taken back, against 550-675 ms every time for O_DIRECT,
// storage included. Every direct block lies wholly inside one write and writes never overlap, so
// no block is ever written both ways; the partial blocks at either end of a write go through the
// buffered descriptor. Source memory that is not block-aligned is copied through a bounce buffer
// of each writing thread's own (kDirectBounceBytes, kept for the thread's life).
constexpr uint64_t kDirectBlock = 4096;
constexpr size_t kMinDirectBytes = size_t{1} << 20;
constexpr size_t kDirectBounceBytes = size_t{4} << 20;

// Writes [offset, offset + size) through an O_DIRECT descriptor: offset and size are multiples
// of kDirectBlock. Returns 0 or an errno; EINVAL when the file system wants other alignment.
int PwriteDirect(int fd, const char* data, size_t size, uint64_t offset) {
  if (reinterpret_cast<uintptr_t>(data) % kDirectBlock == 0) {
    return PwriteFully(fd, data, size, offset);
  }
  thread_local StagingBuffer bounce;
  if (bounce.size() == 0) bounce = StagingBuffer(kDirectBounceBytes);  // mapped: page-aligned
  while (size > 0) {
    const size_t n = std::min(size, kDirectBounceBytes);
    std::memcpy(bounce.data(), data, n);
    if (int error = PwriteFully(fd, bounce.data(), n, offset)) return error;
    data += n;
    size -= n;
    offset += n;
  }
  return 0;
}

class FileWritableFile final : public WritableFile {
 public:
  FileWritableFile(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  // A close error is lost here; callers that need it call Close() themselves.
  ~FileWritableFile() override { (void)Close(); }

  Status WriteAt(uint64_t offset, const void* data, size_t size) override {
    TS_RETURN_IF_ERROR(CheckOpen("write"));
    const char* bytes = static_cast<const char*>(data);
    if (size >= kMinDirectBytes && direct_fd_.valid() &&
        direct_ok_.load(std::memory_order_relaxed) && offset <= kMaxOffset - size) {
      // The whole blocks inside the write go direct; the partial ones at its ends, buffered.
      const uint64_t begin = (offset + kDirectBlock - 1) / kDirectBlock * kDirectBlock;
      const uint64_t end = (offset + size) / kDirectBlock * kDirectBlock;
      if (end > begin && end - begin >= kMinDirectBytes) {
        TS_RETURN_IF_ERROR(WriteBuffered(offset, bytes, begin - offset));
        const int error =
            PwriteDirect(direct_fd_.get(), bytes + (begin - offset), end - begin, begin);
        if (error == EINVAL) {
          // This file system wants other alignment: buffered from now on (the same bytes again).
          direct_ok_.store(false, std::memory_order_relaxed);
          TS_RETURN_IF_ERROR(WriteBuffered(begin, bytes + (begin - offset), end - begin));
        } else if (error != 0) {
          return FsError(error, StrCat("write ", end - begin, " bytes at offset ", begin, " of"),
                         path_);
        }
        return WriteBuffered(end, bytes + (end - offset), offset + size - end);
      }
    }
    return WriteBuffered(offset, bytes, size);
  }

  void PreferDirectWrites() override {
    if (!fd_.valid() || direct_fd_.valid()) return;
    const std::string self = StrCat("/proc/self/fd/", fd_.get());
    // Without /proc, or on a file system without O_DIRECT, writes stay buffered.
    direct_fd_ = UniqueFd(
        RetryOnEintr([&] { return ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC); }));
  }

  Status Sync() override {
    TS_RETURN_IF_ERROR(CheckOpen("sync"));
    if (int error = FsyncFd(fd_.get())) return FsError(error, "sync", path_);
    return OkStatus();
  }

  // sync_file_range(WRITE) queues the file's dirty pages that are not yet under writeback and
  // returns; it is not a durability barrier (the final fsync is).
  Status StartWriteback() override {
    TS_RETURN_IF_ERROR(CheckOpen("start writeback of"));
    if (RetryOnEintr([&] { return ::sync_file_range(fd_.get(), 0, 0, SYNC_FILE_RANGE_WRITE); }) !=
        0) {
      return FsError(errno, "start writeback of", path_);
    }
    return OkStatus();
  }

  Status Close() override {
    TS_RETURN_IF_ERROR(CheckOpen("close"));
    const int direct_error = direct_fd_.valid() ? CloseFd(direct_fd_) : 0;
    if (int error = CloseFd(fd_)) return FsError(error, "close", path_);
    if (direct_error != 0) return FsError(direct_error, "close", path_);
    return OkStatus();
  }

 private:
  Status CheckOpen(std::string_view operation) const {
    if (fd_.valid()) return OkStatus();
    return FailedPreconditionError(StrCat(operation, " '", path_, "' failed: file already closed"));
  }

  Status WriteBuffered(uint64_t offset, const char* data, size_t size) {
    if (int error = PwriteFully(fd_.get(), data, size, offset)) {
      return FsError(error, StrCat("write ", size, " bytes at offset ", offset, " of"), path_);
    }
    return OkStatus();
  }

  // Not synchronized: Close() and PreferDirectWrites() must not race with other calls (WriteAt
  // from several threads may).
  UniqueFd fd_;
  UniqueFd direct_fd_;  // O_DIRECT, same file; invalid unless PreferDirectWrites() opened it
  std::atomic<bool> direct_ok_{true};
  const std::string path_;
};

class FileReadableFile final : public ReadableFile {
 public:
  FileReadableFile(UniqueFd fd, uint64_t size, std::string path)
      : fd_(std::move(fd)), size_(size), path_(std::move(path)) {}

  uint64_t size() const override { return size_; }

  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    const PreadResult read = PreadFully(fd_.get(), static_cast<char*>(dest), size, offset);
    if (read.error != 0) {
      return FsError(read.error, StrCat("read ", size, " bytes at offset ", offset, " of"), path_);
    }
    if (read.done < size) {
      struct stat st;
      const uint64_t now = ::fstat(fd_.get(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : size_;
      return Truncated(path_, offset, size, now);
    }
    return OkStatus();
  }

  Status MapAt(uint64_t offset, size_t size, void* address) const override {
    if (offset > size_ || size > size_ - offset) return Truncated(path_, offset, size, size_);
    void* mapped = ::mmap(address, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd_.get(),
                          static_cast<off_t>(offset));
    if (mapped == MAP_FAILED) {
      return FsError(errno, StrCat("map ", size, " bytes at offset ", offset, " of"), path_);
    }
    return OkStatus();
  }

 private:
  const UniqueFd fd_;
  const uint64_t size_;
  const std::string path_;
};

}  // namespace

Result<std::unique_ptr<FileKvStore>> FileKvStore::Open(std::string root_dir, bool create) {
  if (root_dir.empty()) return InvalidArgumentError("file store root directory is empty");
  while (root_dir.size() > 1 && root_dir.back() == '/') root_dir.pop_back();
  if (create) {
    // mkdir -p. Failures on the way are left for the final mkdir and open to report: an
    // ancestor we may not create usually exists already.
    for (size_t slash = root_dir.find('/', 1); slash != std::string::npos;
         slash = root_dir.find('/', slash + 1)) {
      ::mkdir(root_dir.substr(0, slash).c_str(), 0777);
    }
    if (::mkdir(root_dir.c_str(), 0777) != 0 && errno != EEXIST) {
      return ErrnoToStatus(errno, "create store root", root_dir);
    }
  }
  const int fd =
      RetryOnEintr([&] { return ::open(root_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); });
  if (fd < 0) return ErrnoToStatus(errno, "open store root", root_dir);
  return std::unique_ptr<FileKvStore>(new FileKvStore(std::move(root_dir), fd));
}

FileKvStore::FileKvStore(std::string root_dir, int root_fd)
    : root_dir_(std::move(root_dir)), root_fd_(root_fd) {}

FileKvStore::~FileKvStore() { ::close(root_fd_); }

std::string FileKvStore::Describe() const { return StrCat("file:", root_dir_); }

std::string FileKvStore::PathOf(std::string_view key) const {
  if (key.empty()) return root_dir_;
  return StrCat(root_dir_, root_dir_ == "/" ? "" : "/", key);
}

Result<std::string> FileKvStore::Read(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, kReadFlags);
  if (opened.error != 0) return FsError(opened.error, "read", path);
  return ReadWhole(opened.fd.get(), path);
}

Status FileKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, kReadFlags);
  if (opened.error != 0) return FsError(opened.error, "read range", path);
  const PreadResult read = PreadFully(opened.fd.get(), static_cast<char*>(dest), size, offset);
  if (read.error == EISDIR) return NotAnObject("read range", path);
  if (read.error != 0) {
    return FsError(read.error, StrCat("read ", size, " bytes at offset ", offset, " of"), path);
  }
  // An empty range needs the size to tell whether it lies past the end; so does the message.
  if (read.done < size || size == 0) {
    struct stat st;
    if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "read range", path);
    TS_RETURN_IF_ERROR(CheckIsObject(st, "read range", path));
    const uint64_t object_size = static_cast<uint64_t>(st.st_size);
    if (read.done < size || offset > object_size) {
      return Truncated(path, offset, size, object_size);
    }
  }
  return OkStatus();
}

Result<uint64_t> FileKvStore::Size(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  // O_PATH: no read permission needed, and a fifo does not block the open.
  OpenResult opened = OpenBeneath(root_fd_, key, O_PATH);
  if (opened.error != 0) return FsError(opened.error, "size", path);
  struct stat st;
  if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "size", path);
  if (S_ISLNK(st.st_mode)) return FsError(ELOOP, "size", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "size", path));
  return static_cast<uint64_t>(st.st_size);
}

Result<std::unique_ptr<ReadableFile>> FileKvStore::OpenForRead(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, kReadFlags);
  if (opened.error != 0) return FsError(opened.error, "open for read", path);
  struct stat st;
  if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "open for read", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "open for read", path));
  return std::make_unique<FileReadableFile>(std::move(opened.fd), static_cast<uint64_t>(st.st_size),
                                            std::move(path));
}

Status FileKvStore::Write(std::string_view key, std::string_view value) {
  return WriteObject(key, value, /*create_only=*/false);
}

Status FileKvStore::WriteIfAbsent(std::string_view key, std::string_view value) {
  return WriteObject(key, value, /*create_only=*/true);
}

Status FileKvStore::WriteObject(std::string_view key, std::string_view value, bool create_only) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  TS_ASSIGN_OR_RETURN(ParentDir parent,
                      OpenParent(root_fd_, key, O_PATH, /*create=*/true, "write", path));
  // Step 1. A long last segment is shortened so that the temporary name stays a legal name.
  const std::string_view stem =
      std::string_view(parent.name)
          .substr(0, std::min(parent.name.size(), kMaxNameLength - kTempSuffixLength));
  std::string temp_name;
  UniqueFd fd;
  for (int attempt = 0; !fd.valid(); ++attempt) {
    temp_name = StrCat(stem, ".tmp.", HexU64(RandomU64()));
    fd = UniqueFd(RetryOnEintr([&] {
      return ::openat(parent.fd, temp_name.c_str(),
                      O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
    }));
    if (!fd.valid() && (errno != EEXIST || attempt >= 3)) {
      return FsError(errno, "write (create temporary file)", path);
    }
  }
  const auto fail = [&](Status status) {
    fd.Reset();
    ::unlinkat(parent.fd, temp_name.c_str(), 0);
    return status;
  };
  // Step 2.
  if (int error = PwriteFully(fd.get(), value.data(), value.size(), 0)) {
    return fail(FsError(error, "write", path));
  }
  if (int error = FsyncFd(fd.get())) return fail(FsError(error, "write (fsync)", path));
  if (int error = CloseFd(fd)) return fail(FsError(error, "write (close)", path));
  if (create_only) {
    // Step 3, create-only: into place only if nothing has the name, atomically (of two writers
    // exactly one wins): renameat2(RENAME_NOREPLACE), or where the file system lacks it, link(2),
    // which never replaces either.
    const auto exists = [&] {
      return fail(
          AlreadyExistsError(StrCat("create-only write of '", path, "' failed: it exists")));
    };
#ifdef RENAME_NOREPLACE
    if (::renameat2(parent.fd, temp_name.c_str(), parent.fd, parent.name.c_str(),
                    RENAME_NOREPLACE) == 0) {
      return OkStatus();
    }
    if (errno == EEXIST) return exists();
    if (errno != EINVAL && errno != ENOSYS)
      return fail(FsError(errno, "write (create-only)", path));
#endif
    if (::linkat(parent.fd, temp_name.c_str(), parent.fd, parent.name.c_str(), 0) != 0) {
      if (errno == EEXIST) return exists();
      return fail(FsError(errno, "write (create-only link)", path));
    }
    ::unlinkat(parent.fd, temp_name.c_str(), 0);
    return OkStatus();
  }
  // Step 3. rename(2) replaces a file or symlink named `key`, but not a directory.
  if (::renameat(parent.fd, temp_name.c_str(), parent.fd, parent.name.c_str()) != 0) {
    if (errno == EISDIR) return fail(IsADirectory("write", path));
    return fail(FsError(errno, "write (rename into place)", path));
  }
  return OkStatus();
}

Result<std::unique_ptr<WritableFile>> FileKvStore::OpenForWrite(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::string path = PathOf(key);
  TS_ASSIGN_OR_RETURN(ParentDir parent,
                      OpenParent(root_fd_, key, O_PATH, /*create=*/true, "open for write", path));
  UniqueFd fd(RetryOnEintr([&] {
    return ::openat(parent.fd, parent.name.c_str(),
                    O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  }));
  if (!fd.valid()) {
    if (errno == EISDIR) return IsADirectory("open for write", path);
    return FsError(errno, "open for write", path);
  }
  return std::make_unique<FileWritableFile>(std::move(fd), std::move(path));
}

Result<std::vector<std::string>> FileKvStore::List(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  // "a/b/ste" lists directory "a/b", keeping the entries that start with "ste".
  const size_t slash = prefix.rfind('/');
  const std::string_view dir =
      slash == std::string_view::npos ? std::string_view() : prefix.substr(0, slash);
  const std::string_view name_filter =
      slash == std::string_view::npos ? prefix : prefix.substr(slash + 1);
  std::vector<std::string> keys;
  OpenResult opened = OpenBeneath(root_fd_, dir, O_RDONLY | O_DIRECTORY);
  if (opened.error != 0) {
    // No such directory (or a file or symlink in its place): no keys under it.
    if (opened.error == ENOENT || opened.error == ENOTDIR || opened.error == ELOOP) return keys;
    return FsError(opened.error, "list", PathOf(prefix));
  }
  const std::string key_base = dir.empty() ? std::string() : StrCat(dir, "/");
  TS_RETURN_IF_ERROR(ListTree(std::move(opened.fd), key_base, name_filter, PathOf(dir), &keys));
  std::sort(keys.begin(), keys.end());
  return keys;
}

Status FileKvStore::Delete(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  TS_ASSIGN_OR_RETURN(ParentDir parent,
                      OpenParent(root_fd_, key, O_PATH, /*create=*/false, "delete", path));
  if (::unlinkat(parent.fd, parent.name.c_str(), 0) != 0) {
    if (errno == EISDIR) return NotAnObject("delete", path);
    return FsError(errno, "delete", path);
  }
  return OkStatus();
}

Status FileKvStore::DeletePrefix(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  if (prefix.empty()) {
    OpenResult root = OpenBeneath(root_fd_, "", O_RDONLY | O_DIRECTORY);
    if (root.error != 0) return FsError(root.error, "delete prefix", root_dir_);
    return RemoveContents(std::move(root.fd), root_dir_);
  }
  if (prefix.back() == '/') {
    // The directory goes too, with everything in it.
    const std::string_view dir = prefix.substr(0, prefix.size() - 1);
    const std::string path = PathOf(dir);
    Result<ParentDir> parent =
        OpenParent(root_fd_, dir, O_PATH, /*create=*/false, "delete prefix", path);
    if (absl::IsNotFound(parent.status())) return OkStatus();
    TS_RETURN_IF_ERROR(parent.status());
    return RemoveTree(parent->fd, parent->name, path, /*directory_only=*/true);
  }
  // "a/b/ste": every entry of directory "a/b" whose name starts with "ste", files and trees.
  const auto [dir, name_filter] = SplitKey(prefix);
  OpenResult opened = OpenBeneath(root_fd_, dir, O_RDONLY | O_DIRECTORY);
  if (opened.error == ENOENT || opened.error == ENOTDIR) return OkStatus();
  if (opened.error != 0) return FsError(opened.error, "delete prefix", PathOf(prefix));
  const std::string dir_path = PathOf(dir);
  DirStream stream;
  std::vector<DirEntry> entries;
  if (int error = ReadDirectory(std::move(opened.fd), &stream, &entries); error != 0) {
    return FsError(error, "delete prefix (read directory)", dir_path);
  }
  for (const DirEntry& entry : entries) {
    if (!entry.name.starts_with(name_filter)) continue;
    TS_RETURN_IF_ERROR(
        RemoveEntry(::dirfd(stream.get()), entry.name, StrCat(dir_path, "/", entry.name)));
  }
  return OkStatus();
}

Status FileKvStore::RenameDirectory(std::string_view from, std::string_view to) {
  TS_RETURN_IF_ERROR(ValidateKey(from));
  TS_RETURN_IF_ERROR(ValidateKey(to));
  const std::string from_path = PathOf(from);
  const std::string to_path = PathOf(to);
  const std::string operation = StrCat("rename directory '", from_path, "' to");
  if (to.size() > from.size() && to.starts_with(from) && to[from.size()] == '/') {
    return InvalidArgumentError(
        StrCat(operation, " '", to_path, "' failed: target is inside the source"));
  }
  TS_ASSIGN_OR_RETURN(ParentDir source, OpenParent(root_fd_, from, O_PATH, /*create=*/false,
                                                   "rename directory", from_path));
  struct stat st;
  if (::fstatat(source.fd, source.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return FsError(errno, "rename directory", from_path);
  }
  if (!S_ISDIR(st.st_mode)) {
    return NotFoundError(StrCat("rename directory '", from_path, "' failed: not a directory"));
  }
  TS_ASSIGN_OR_RETURN(ParentDir target,
                      OpenParent(root_fd_, to, O_PATH, /*create=*/true, operation, to_path));
  const auto exists = [&] {
    return AlreadyExistsError(StrCat(operation, " '", to_path, "' failed: target exists"));
  };
#ifdef RENAME_NOREPLACE
  if (::renameat2(source.fd, source.name.c_str(), target.fd, target.name.c_str(),
                  RENAME_NOREPLACE) == 0) {
    return OkStatus();
  }
  if (errno == EEXIST) return exists();
  // Filesystems without RENAME_NOREPLACE say EINVAL; old kernels or libcs say ENOSYS.
  if (errno != EINVAL && errno != ENOSYS) return FsError(errno, operation, to_path);
#endif
  // Without RENAME_NOREPLACE: check, then rename. A target created in between is replaced if it
  // is an empty directory, and fails the rename (ENOTEMPTY) otherwise.
  if (::fstatat(target.fd, target.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return exists();
  if (errno != ENOENT) return FsError(errno, operation, to_path);
  if (::renameat(source.fd, source.name.c_str(), target.fd, target.name.c_str()) != 0) {
    if (errno == EEXIST || errno == ENOTEMPTY) return exists();
    return FsError(errno, operation, to_path);
  }
  return OkStatus();
}

KvStoreCapabilities FileKvStore::Capabilities() const {
  KvStoreCapabilities capabilities;
  capabilities.rename = true;
#ifdef RENAME_EXCHANGE
  capabilities.exchange = true;  // where the file system allows it; else Unimplemented, per call
#endif
  capabilities.conditional_write = true;
  capabilities.generations = true;
  capabilities.locks = true;
  capabilities.mapping = true;
  capabilities.pinned_views = true;
  return capabilities;
}

namespace {

// Device, inode, modification time and size: a file replaced by rename (Write) has a new inode;
// one rewritten in place (OpenForWrite) a new modification time or size.
std::string GenerationOf(const struct stat& st) {
  return StrCat(st.st_dev, ":", st.st_ino, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ":",
                st.st_size);
}

}  // namespace

Result<ObjectInfo> FileKvStore::Stat(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, O_PATH);
  if (opened.error != 0) return FsError(opened.error, "stat", path);
  struct stat st;
  if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "stat", path);
  if (S_ISLNK(st.st_mode)) return FsError(ELOOP, "stat", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "stat", path));
  return ObjectInfo{static_cast<uint64_t>(st.st_size), GenerationOf(st),
                    std::chrono::system_clock::time_point(
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::seconds(st.st_mtim.tv_sec) +
                            std::chrono::nanoseconds(st.st_mtim.tv_nsec)))};
}

Status FileKvStore::ReadRangeAtGeneration(std::string_view key, std::string_view generation,
                                          uint64_t offset, size_t size, void* dest) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, kReadFlags);
  if (opened.error != 0) return FsError(opened.error, "read range", path);
  // The descriptor pins one version: compare its generation, then read from it.
  struct stat st;
  if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "read range", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "read range", path));
  if (GenerationOf(st) != generation) {
    return FailedPreconditionError(StrCat("read of '", path,
                                          "' failed: the object was replaced "
                                          "(generation ",
                                          GenerationOf(st), ", expected ", generation, ")"));
  }
  const PreadResult read = PreadFully(opened.fd.get(), static_cast<char*>(dest), size, offset);
  if (read.error != 0) {
    return FsError(read.error, StrCat("read ", size, " bytes at offset ", offset, " of"), path);
  }
  if (read.done < size) return Truncated(path, offset, size, static_cast<uint64_t>(st.st_size));
  return OkStatus();
}

Result<ListedChildren> FileKvStore::ListChildren(std::string_view prefix) {
  TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
  if (!prefix.empty() && prefix.back() != '/') return KvStore::ListChildren(prefix);
  // One directory read: the entries of the folder `prefix` names (symlinks skipped, as List).
  const std::string_view dir = prefix.empty() ? prefix : prefix.substr(0, prefix.size() - 1);
  ListedChildren children;
  OpenResult opened = OpenBeneath(root_fd_, dir, O_RDONLY | O_DIRECTORY);
  if (opened.error == ENOENT || opened.error == ENOTDIR) return children;
  if (opened.error != 0) return FsError(opened.error, "list", PathOf(dir));
  DIR* stream = ::fdopendir(opened.fd.get());
  if (stream == nullptr) return FsError(errno, "list", PathOf(dir));
  opened.fd.Release();  // owned by `stream` now
  while (struct dirent* entry = ::readdir(stream)) {
    const std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::fstatat(::dirfd(stream), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      children.prefixes.push_back(StrCat(prefix, name, "/"));
    } else if (S_ISREG(st.st_mode)) {
      children.keys.push_back(StrCat(prefix, name));
    }
  }
  ::closedir(stream);
  std::sort(children.keys.begin(), children.keys.end());
  std::sort(children.prefixes.begin(), children.prefixes.end());
  return children;
}

Status FileKvStore::ExchangeDirectories(std::string_view a, std::string_view b) {
  TS_RETURN_IF_ERROR(ValidateKey(a));
  TS_RETURN_IF_ERROR(ValidateKey(b));
  const std::string a_path = PathOf(a);
  const std::string b_path = PathOf(b);
  const std::string operation = StrCat("exchange directories '", a_path, "' and");
#ifdef RENAME_EXCHANGE
  TS_ASSIGN_OR_RETURN(ParentDir first, OpenParent(root_fd_, a, O_PATH, /*create=*/false,
                                                  "exchange directories", a_path));
  TS_ASSIGN_OR_RETURN(ParentDir second, OpenParent(root_fd_, b, O_PATH, /*create=*/false,
                                                   "exchange directories", b_path));
  // Both must be directories (never symlinks): the exchange would move whatever is there.
  for (const auto& [dir, path] : {std::pair(&first, &a_path), std::pair(&second, &b_path)}) {
    struct stat st;
    if (::fstatat(dir->fd, dir->name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return FsError(errno, "exchange directories", *path);
    }
    if (!S_ISDIR(st.st_mode)) {
      return FailedPreconditionError(
          StrCat(operation, " '", b_path, "' failed: '", *path, "' is not a directory"));
    }
  }
  if (::renameat2(first.fd, first.name.c_str(), second.fd, second.name.c_str(), RENAME_EXCHANGE) ==
      0) {
    return OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS) return FsError(errno, operation, b_path);
#endif
  return UnimplementedError(StrCat(operation, " '", b_path, "' failed: not supported here"));
}

Result<std::unique_ptr<KvStore>> FileKvStore::OpenFolderView(std::string_view folder) {
  TS_RETURN_IF_ERROR(ValidateKey(folder));
  std::string path = PathOf(folder);
  OpenResult opened = OpenBeneath(root_fd_, folder, O_RDONLY | O_DIRECTORY);
  if (opened.error != 0) return FsError(opened.error, "open folder", path);
  std::unique_ptr<KvStore> pinned(new FileKvStore(std::move(path), opened.fd.Release()));
  KvStore* target = pinned.get();
  return std::unique_ptr<KvStore>(
      std::make_unique<FolderView>(std::string(folder), target, "", std::move(pinned)));
}

Status FileKvStore::Sync(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  OpenResult opened = OpenBeneath(root_fd_, key, kReadFlags);
  if (opened.error != 0) return FsError(opened.error, "sync", path);
  struct stat st;
  if (::fstat(opened.fd.get(), &st) != 0) return FsError(errno, "sync", path);
  TS_RETURN_IF_ERROR(CheckIsObject(st, "sync", path));
  if (int error = FsyncFd(opened.fd.get())) return FsError(error, "sync", path);
  // The directory entry: without this a new object may be gone after a crash.
  TS_ASSIGN_OR_RETURN(ParentDir parent, OpenParent(root_fd_, key, O_RDONLY, /*create=*/false,
                                                   "sync (open parent directory)", path));
  if (int error = FsyncFd(parent.fd)) return FsError(error, "sync (parent directory)", path);
  return OkStatus();
}

Status FileKvStore::SyncDirectory(std::string_view dir) {
  TS_RETURN_IF_ERROR(ValidatePrefix(dir));
  if (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  const std::string path = PathOf(dir);
  OpenResult opened = OpenBeneath(root_fd_, dir, O_RDONLY | O_DIRECTORY);
  if (opened.error != 0) return FsError(opened.error, "sync directory", path);
  if (int error = FsyncFd(opened.fd.get())) return FsError(error, "sync directory", path);
  return OkStatus();
}

namespace {

// Holds an flock()ed descriptor; closing it releases the lock.
class FileKvLock final : public KvLock {
 public:
  explicit FileKvLock(UniqueFd fd) : fd_(std::move(fd)) {}

 private:
  UniqueFd fd_;
};

}  // namespace

Result<std::unique_ptr<KvLock>> FileKvStore::TryLock(std::string_view key) {
  TS_RETURN_IF_ERROR(ValidateKey(key));
  std::string path = PathOf(key);
  TS_ASSIGN_OR_RETURN(ParentDir parent,
                      OpenParent(root_fd_, key, O_PATH, /*create=*/true, "lock", path));
  // O_RDWR rather than O_RDONLY only so that an existing lock file need not be readable-only;
  // the file's content is never used. No O_TRUNC: another holder may be using it.
  UniqueFd fd(RetryOnEintr([&] {
    return ::openat(parent.fd, parent.name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
                    0666);
  }));
  if (!fd.valid()) {
    if (errno == EISDIR) return IsADirectory("lock", path);
    return FsError(errno, "lock", path);
  }
  // flock locks belong to the open file description, so a second TryLock in this same process
  // (a new open) conflicts too, as it must for two managers in one process.
  if (RetryOnEintr([&] { return ::flock(fd.get(), LOCK_EX | LOCK_NB); }) != 0) {
    if (errno == EWOULDBLOCK) {
      return FailedPreconditionError(
          StrCat(Describe(), " is locked by another manager (", path, ")"));
    }
    return FsError(errno, "lock", path);
  }
  return std::unique_ptr<KvLock>(std::make_unique<FileKvLock>(std::move(fd)));
}

Status RegisterFileKvStore() {
  return RegisterKvStoreScheme(
      "file",
      [](std::string_view rest,
         const OpenStoreOptions& options) -> Result<std::unique_ptr<KvStore>> {
        TS_RETURN_IF_ERROR(CheckDriverOptions("file", rest, options, {}));
        TS_ASSIGN_OR_RETURN(std::unique_ptr<FileKvStore> store,
                            FileKvStore::Open(std::string(rest), options.create));
        return std::unique_ptr<KvStore>(std::move(store));
      });
}

namespace {
const KvStoreDriverRegistration kRegistered(&RegisterFileKvStore);
}  // namespace

}  // namespace tensorstash
