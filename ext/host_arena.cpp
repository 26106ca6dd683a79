// Host arena: one memfd shared-memory region, mapped MAP_SHARED, with an allocator of 4 KiB-aligned
// regions (best fit, free extents coalesced on free).
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include "host_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "failure.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

namespace flash {
namespace {

Failure arena_error(int err, const std::string& what) {
    Failure f = simple_failure("ArenaError", what + ": " + std::strerror(err) + " [errno " +
                                                 std::to_string(err) + "]");
    f.err = err;
    return f;
}

}  // namespace

HostArena::HostArena(size_t size, const std::string& name) {
    if (size == 0 || size % kAlign) throw argument_failure("HostArena size must be a positive multiple of 4096, not " + std::to_string(size));
    fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC);
    if (fd_ < 0) throw arena_error(errno, "memfd_create(" + name + ")");
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
        int e = errno;
        ::close(fd_);
        throw arena_error(e, "ftruncate memfd to " + std::to_string(size) + " bytes");
    }
    size_ = size;
    map(false);
    insert_free(0, size);
}

HostArena* HostArena::attach(int fd, size_t size) {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw arena_error(errno, "fstat arena fd " + std::to_string(fd));
    if (size == 0 || static_cast<uint64_t>(st.st_size) < size)
        throw argument_failure("attach: fd " + std::to_string(fd) + " holds " + std::to_string(st.st_size) +
                                    " bytes, asked to map " + std::to_string(size));
    auto* a = new HostArena();
    a->fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (a->fd_ < 0) {
        int e = errno;
        delete a;
        throw arena_error(e, "dup arena fd");
    }
    a->size_ = size;
    a->attached_ = true;
    try {
        a->map(false);
    } catch (...) {
        delete a;
        throw;
    }
    return a;
}

void HostArena::map(bool populate) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd_, 0);
    if (p == MAP_FAILED) throw arena_error(errno, "mmap arena of " + std::to_string(size_) + " bytes");
    base_ = static_cast<char*>(p);
}

HostArena::~HostArena() {
    if (base_) ::munmap(base_, size_);
    if (fd_ >= 0) ::close(fd_);
}

const char* HostArena::populate() {
    if (::madvise(base_, size_, MADV_POPULATE_WRITE) == 0) return "madvise";
    if (errno != EINVAL) throw arena_error(errno, "madvise(MADV_POPULATE_WRITE)");
    // Kernels before 5.14: a no-op atomic add writes each page without changing its bytes, which
    // is safe while another process writes the same memory.
    for (size_t off = 0; off < size_; off += kAlign)
        __atomic_fetch_add(reinterpret_cast<volatile char*>(base_ + off), 0, __ATOMIC_RELAXED);
    return "touch";
}

void HostArena::insert_free(uint64_t off, size_t len) {
    free_by_offset_.emplace(off, len);
    free_by_size_.emplace(len, off);
}

void HostArena::erase_free(std::map<uint64_t, size_t>::iterator it) {
    free_by_size_.erase({it->second, it->first});
    free_by_offset_.erase(it);
}

uint64_t HostArena::alloc(size_t nbytes) {
    if (attached_) throw simple_failure("ArenaError", "alloc on an attached arena: the creating process allocates");
    if (nbytes == 0) throw argument_failure("alloc: nbytes must be positive");
    size_t len = (nbytes + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lk(mu_);
    auto fit = free_by_size_.lower_bound({len, 0});
    if (fit == free_by_size_.end()) {
        Failure f = simple_failure("ArenaFull", "host arena full: " + std::to_string(nbytes) + " bytes requested, " +
                                                    std::to_string(size_ - used_) + " free, largest free extent " +
                                                    std::to_string(free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first));
        f.expected = static_cast<int64_t>(nbytes);
        f.actual = static_cast<int64_t>(free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first);
        throw f;
    }
    uint64_t off = fit->second;
    size_t have = fit->first;
    erase_free(free_by_offset_.find(off));
    if (have > len) insert_free(off + len, have - len);
    allocated_.emplace(off, len);
    used_ += len;
    return off;
}

void HostArena::free(uint64_t offset) {
    if (attached_) throw simple_failure("ArenaError", "free on an attached arena: the creating process frees");
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocated_.find(offset);
    if (it == allocated_.end())
        throw simple_failure("ArenaError", "free of offset " + std::to_string(offset) + ": not an allocation");
    uint64_t off = it->first;
    size_t len = it->second;
    allocated_.erase(it);
    used_ -= len;
    // Coalesce with the free neighbours on both sides, so free space never stays split at a boundary
    // that no allocation holds.
    auto next = free_by_offset_.lower_bound(off);
    if (next != free_by_offset_.end() && next->first == off + len) {
        len += next->second;
        erase_free(next);
    }
    auto after = free_by_offset_.lower_bound(off);
    if (after != free_by_offset_.begin()) {
        auto prev = std::prev(after);
        if (prev->first + prev->second == off) {
            off = prev->first;
            len += prev->second;
            erase_free(prev);
        }
    }
    insert_free(off, len);
}

size_t HostArena::allocation_size(uint64_t offset) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocated_.find(offset);
    return it == allocated_.end() ? 0 : it->second;
}

size_t HostArena::used() const {
    std::lock_guard<std::mutex> lk(mu_);
    return used_;
}

size_t HostArena::largest_free() const {
    std::lock_guard<std::mutex> lk(mu_);
    return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

size_t HostArena::free_extents() const {
    std::lock_guard<std::mutex> lk(mu_);
    return free_by_offset_.size();
}

size_t HostArena::allocations() const {
    std::lock_guard<std::mutex> lk(mu_);
    return allocated_.size();
}

}  // namespace flash
