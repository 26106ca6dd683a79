// Host arena: one memfd shared-memory region, mapped MAP_SHARED, with an allocator of 4 KiB-aligned
// regions (best fit, free extents coalesced on free). Another process maps the same memory with
// attach(fd, size); only the creating process allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace flash {

class HostArena {
public:
    static constexpr size_t kAlign = 4096;

    HostArena(size_t size, const std::string& name);     // creates the memfd
    static HostArena* attach(int fd, size_t size);         // dup()s fd; the caller keeps its own
    ~HostArena();
    HostArena(const HostArena&) = delete;
    HostArena& operator=(const HostArena&) = delete;

    uint64_t alloc(size_t nbytes);   // offset; Failure("ArenaFull") when no extent fits
    void free(uint64_t offset);
    size_t allocation_size(uint64_t offset) const;

    int fd() const { return fd_; }
    size_t size() const { return size_; }
    size_t used() const;
    size_t largest_free() const;
    size_t free_extents() const;
    size_t allocations() const;
    bool attached() const { return attached_; }
    char* base() const { return base_; }
    // Faults every page in now (registering unpopulated memory with CUDA is slow). Returns
    // the method used: "madvise" (MADV_POPULATE_WRITE) or "touch".
    const char* populate();

private:
    HostArena() = default;
    void map(bool populate);
    void insert_free(uint64_t off, size_t len);
    void erase_free(std::map<uint64_t, size_t>::iterator it);

    int fd_ = -1;
    size_t size_ = 0;
    char* base_ = nullptr;
    bool attached_ = false;

    mutable std::mutex mu_;
    std::map<uint64_t, size_t> free_by_offset_;           // offset -> length
    std::set<std::pair<size_t, uint64_t>> free_by_size_;  // (length, offset): best fit, lowest offset
    std::map<uint64_t, size_t> allocated_;                // offset -> length
    size_t used_ = 0;
};

}  // namespace flash
