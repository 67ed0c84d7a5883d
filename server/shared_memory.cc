#include "server/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "core/verify.h"

namespace attnserve {
namespace {

// The fault guard: the address ranges of every mapped region, readable from
// a signal handler (lock-free), and the SIGBUS handler that rescues reads of
// pages a client truncated away.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};
std::array<GuardSlot, kMaxSharedMemoryRegions> guard_slots;
Mutex guard_mu;  // serializes claiming and releasing slots
struct sigaction previous_sigbus;
size_t page_size = 4096;

void ChainToPrevious(int signal, siginfo_t* info, void* context) {
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_sigbus.sa_handler != SIG_DFL &&
      previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(signal);
    return;
  }
  // Not ours and nobody else's: die of it as without a handler once the
  // faulting instruction runs again.
  ::signal(SIGBUS, SIG_DFL);
}

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : guard_slots) {
    if (address >= slot.begin.load(std::memory_order_acquire) &&
        address < slot.end.load(std::memory_order_acquire)) {
      // A page of a region whose object shrank: put a zero page in its place
      // (mmap is a plain system call, safe here) and let the access go on;
      // the call sees the mark and fails.
      void* page = reinterpret_cast<void*>(address & ~(page_size - 1));
      if (mmap(page, page_size, PROT_READ | PROT_WRITE,
               MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
        slot.faulted.store(true, std::memory_order_release);
        return;
      }
    }
  }
  ChainToPrevious(signal, info, context);
}

void InstallGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    page_size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    struct sigaction action {};
    action.sa_sigaction = &OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// A free slot for [begin, end), or -1 when all are taken.
int ClaimGuardSlot(uintptr_t begin, uintptr_t end) {
  InstallGuard();
  MutexLock lock(&guard_mu);
  for (int i = 0; i < kMaxSharedMemoryRegions; ++i) {
    GuardSlot& slot = guard_slots[i];
    if (slot.end.load() == 0) {
      slot.faulted.store(false);
      slot.begin.store(begin, std::memory_order_release);
      slot.end.store(end, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void ReleaseGuardSlot(int index) {
  MutexLock lock(&guard_mu);
  guard_slots[index].end.store(0, std::memory_order_release);
  guard_slots[index].begin.store(0, std::memory_order_release);
}

// Also checked where a name is looked up: a name no region can have is a
// malformed request, and is not echoed (a long one would not fit in the
// status a client accepts).
absl::Status VerifyRegionName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be 1 to 128 characters, got ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' &&
        c != '-' && c != '.') {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": only letters, digits, '_', '-' and '.' are allowed"));
    }
  }
  return absl::OkStatus();
}

// "/NAME" for "NAME" or "/NAME": one path component under /dev/shm.
absl::StatusOr<std::string> NormalizedKey(absl::string_view key) {
  if (!key.empty() && key.front() == '/') key.remove_prefix(1);
  if (key.empty() || key.size() > 250 || key == "." || key == ".." ||
      key.find('/') != absl::string_view::npos ||
      key.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: expected a POSIX shared memory name such as \"/my_region\" (one "
        "name under /dev/shm, no other '/', at most 250 characters), got ",
        EchoString(key, '"')));
  }
  return absl::StrCat("/", key);
}

absl::Status OpenError(const std::string& key, int error) {
  const std::string message =
      absl::StrCat("key: cannot open shared memory object ",
                   EchoString(key, '"'), ": ", std::strerror(error));
  if (error == ENOENT) return absl::NotFoundError(message);
  if (error == EACCES || error == EPERM) {
    return absl::PermissionDeniedError(message);
  }
  return absl::InvalidArgumentError(message);
}

}  // namespace

SharedMemoryRegion::SharedMemoryRegion(SharedMemoryRegionInfo info, int fd,
                                       char* map_base, size_t map_length,
                                       int guard_slot)
    : info_(std::move(info)),
      fd_(fd),
      map_base_(map_base),
      map_length_(map_length),
      window_(map_base + map_length - info_.byte_size),
      guard_slot_(guard_slot) {}

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Map(
    SharedMemoryRegionInfo info) {
  ATTN_ASSIGN_OR_RETURN(info.key, NormalizedKey(info.key));
  if (info.byte_size == 0) {
    return absl::InvalidArgumentError("byte_size: must be > 0");
  }
  if (info.offset > (uint64_t{1} << 62) ||
      info.byte_size > (uint64_t{1} << 62)) {
    return absl::InvalidArgumentError(absl::StrCat(
        info.offset > (uint64_t{1} << 62) ? "offset" : "byte_size", ": offset ",
        info.offset, " + byte_size ", info.byte_size, " is too large"));
  }
  const int fd = shm_open(info.key.c_str(), O_RDWR, 0);
  if (fd < 0) return OpenError(info.key, errno);
  struct stat st {};
  if (fstat(fd, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < info.offset + info.byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "byte_size: offset ", info.offset, " + byte_size ", info.byte_size,
        " exceeds the ", st.st_size, " bytes of shared memory object ",
        EchoString(info.key, '"')));
  }
  InstallGuard();
  const uint64_t map_offset = info.offset & ~(uint64_t{page_size} - 1);
  const size_t map_length = info.offset + info.byte_size - map_offset;
  void* base = mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("byte_size: cannot map ", info.byte_size, " bytes of ",
                     EchoString(info.key, '"'), ": ", std::strerror(error)));
  }
  const auto begin = reinterpret_cast<uintptr_t>(base);
  const int slot = ClaimGuardSlot(begin, begin + map_length);
  if (slot < 0) {
    munmap(base, map_length);
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("name: more than ", kMaxSharedMemoryRegions,
                     " shared memory regions are mapped; unregister some"));
  }
  return std::unique_ptr<SharedMemoryRegion>(new SharedMemoryRegion(
      std::move(info), fd, static_cast<char*>(base), map_length, slot));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  // The slot goes first: once unmapped, the addresses may be reused.
  ReleaseGuardSlot(guard_slot_);
  munmap(map_base_, map_length_);
  close(fd_);
}

absl::StatusOr<char*> SharedMemoryRegion::Slice(uint64_t offset, uint64_t size,
                                                uint64_t alignment,
                                                absl::string_view field) const {
  if (offset > info_.byte_size || size > info_.byte_size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shared memory offset ", offset, " + byte_size ",
                     size, " exceeds region ", EchoString(info_.name), " of ",
                     info_.byte_size, " bytes"));
  }
  char* data = window_ + offset;
  if (alignment > 1 && reinterpret_cast<uintptr_t>(data) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shared memory offset ", offset, " in region ",
                     EchoString(info_.name), " is not aligned to ", alignment,
                     " bytes (the element size)"));
  }
  return data;
}

absl::Status SharedMemoryRegion::VerifyIntact() const {
  struct stat st {};
  const bool shrank =
      fstat(fd_, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < info_.offset + info_.byte_size;
  if (shrank || guard_slots[guard_slot_].faulted.load()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory region ", EchoString(info_.name), ": its object ",
        EchoString(info_.key, '"'), " is now ", st.st_size,
        " bytes, smaller than offset ", info_.offset, " + byte_size ",
        info_.byte_size, "; register the region again after resizing it"));
  }
  return absl::OkStatus();
}

SharedMemoryRegistry::SharedMemoryRegistry(uint64_t max_bytes)
    : max_bytes_(max_bytes) {}

absl::Status SharedMemoryRegistry::VerifyRoomFor(
    const SharedMemoryRegionInfo& info) const {
  if (regions_.count(info.name) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: shared memory region ", EchoString(info.name),
                     " is already registered; unregister it first"));
  }
  if (info.byte_size > max_bytes_ - registered_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "byte_size: ", info.byte_size, " more bytes would exceed the ",
        max_bytes_ >> 20,
        " MiB of shared memory this server maps (--max_shared_memory_mb; ",
        registered_bytes_, " bytes registered)"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Register(
    const SharedMemoryRegionInfo& info) {
  if (absl::Status valid = VerifyRegionName(info.name, "name"); !valid.ok()) {
    return valid;
  }
  {
    MutexLock lock(&mu_);
    if (absl::Status room = VerifyRoomFor(info); !room.ok()) return room;
  }
  // Mapped outside the lock (opening and mapping take a while), so checked
  // again after: another registration may have come meanwhile.
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SharedMemoryRegion> region,
                        SharedMemoryRegion::Map(info));
  MutexLock lock(&mu_);
  if (absl::Status room = VerifyRoomFor(info); !room.ok()) return room;
  registered_bytes_ += info.byte_size;
  regions_.emplace(info.name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(absl::string_view name) {
  // Regions are released outside the lock: unmapping takes a while, and
  // calls may still hold them (then they go when those calls finish).
  if (!name.empty()) ATTN_RETURN_IF_ERROR(VerifyRegionName(name, "name"));
  std::vector<std::shared_ptr<const SharedMemoryRegion>> released;
  MutexLock lock(&mu_);
  if (name.empty()) {
    for (auto& [unused, region] : regions_) released.push_back(region);
    regions_.clear();
    registered_bytes_ = 0;
    return absl::OkStatus();
  }
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "name: shared memory region ", EchoString(name), " is not registered"));
  }
  registered_bytes_ -= it->second->info().byte_size;
  released.push_back(std::move(it->second));
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>>
SharedMemoryRegistry::Find(absl::string_view name,
                           absl::string_view field) const {
  ATTN_RETURN_IF_ERROR(VerifyRegionName(name, absl::StrCat(field, ".region")));
  MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat(field, ": shared memory region ", EchoString(name),
                     " is not registered (RegisterSharedMemory first)"));
  }
  return it->second;
}

absl::StatusOr<std::vector<SharedMemoryRegionInfo>> SharedMemoryRegistry::List(
    absl::string_view name) const {
  if (!name.empty()) ATTN_RETURN_IF_ERROR(VerifyRegionName(name, "name"));
  MutexLock lock(&mu_);
  std::vector<SharedMemoryRegionInfo> infos;
  for (const auto& [region_name, region] : regions_) {
    if (name.empty() || region_name == name) infos.push_back(region->info());
  }
  if (!name.empty() && infos.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "name: shared memory region ", EchoString(name), " is not registered"));
  }
  return infos;
}

uint64_t SharedMemoryRegistry::registered_bytes() const {
  MutexLock lock(&mu_);
  return registered_bytes_;
}

absl::StatusOr<char*> CallSharedMemory::Resolve(const v1::SharedMemoryRef& ref,
                                                uint64_t byte_size,
                                                uint64_t alignment,
                                                absl::string_view field) {
  if (registry_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this server has no shared memory"));
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const SharedMemoryRegion> region,
                        registry_->Find(ref.region(), field));
  if (std::find(held_.begin(), held_.end(), region) == held_.end()) {
    ATTN_RETURN_IF_ERROR(region->VerifyIntact());
    held_.push_back(region);
  }
  return region->Slice(ref.offset(), byte_size, alignment, field);
}

absl::Status CallSharedMemory::VerifyIntact() const {
  for (const auto& region : held_) {
    ATTN_RETURN_IF_ERROR(region->VerifyIntact());
  }
  return absl::OkStatus();
}

}  // namespace attnserve
