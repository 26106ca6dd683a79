// IO engine: batched reads of (path, offset, length) extents into caller memory.
//
// Two backends behind one bookkeeping core: io_uring driven through raw syscalls by one ring
// thread, and a pool of preadv threads (chosen when io_uring_setup is refused, or on request).
// Extents are split into request_size chunks, kept queue_depth deep, read with O_DIRECT where the
// offset and destination are 4 KiB aligned (an unaligned tail goes through a 4 KiB bounce page,
// a misaligned head through the page cache). Short reads are continued; end of file before the
// extent's length is an error carrying the offset. Nothing here touches Python.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "failure.h"

namespace flash {

struct ReadSpec {
    std::string path;
    uint64_t offset = 0;
    size_t length = 0;
    char* dest = nullptr;
    int64_t block_id = -1;
    bool has_crc = false;
    uint32_t expected_crc = 0;
    std::shared_ptr<void> hold;  // keeps the destination alive; handed back on the completion
};

struct CompletionRec {
    uint64_t batch = 0;
    size_t index = 0;           // position in the submitted list
    int64_t block_id = -1;
    int status = 0;             // 0 or -errno
    uint64_t bytes = 0;         // bytes landed in the destination
    bool crc_checked = false;
    bool crc_ok = true;         // false only when checked and different
    uint32_t crc = 0;           // computed crc (when checked)
    uint32_t expected_crc = 0;
    bool eof = false;           // status is -EIO because the file ended early
    std::string path;
    uint64_t offset = 0;
    int64_t error_offset = -1;  // file offset of the failed read
    size_t length = 0;
    std::shared_ptr<void> hold;
};

struct EngineStats {
    uint64_t bytes_read = 0, extents_done = 0, extents_failed = 0, reads_issued = 0, short_reads = 0,
             open_files = 0;
    uint64_t peak_in_flight = 0;  // most reads in flight at once since start or the last set_shape
};

class IOEngine {
public:
    static constexpr size_t kAlign = 4096;

    // backend: "auto" | "io_uring" | "threads".
    IOEngine(const std::string& backend, unsigned queue_depth, size_t request_size, bool direct);
    ~IOEngine();
    IOEngine(const IOEngine&) = delete;
    IOEngine& operator=(const IOEngine&) = delete;

    const std::string& backend() const { return backend_; }
    unsigned queue_depth() const { return queue_depth_; }
    size_t request_size() const { return request_size_; }
    // The read shape from now on: at most `depth` reads in flight (1..queue_depth) of at most
    // `request_size` bytes (a positive multiple of 4096). Reads already in flight finish as they
    // were issued; the next ones follow the new shape. Constructed at (queue_depth, request_size).
    void set_shape(unsigned depth, size_t request_size);
    unsigned shape_depth() const;
    size_t shape_request_size() const;
    bool direct() const { return direct_; }
    // Why "auto" did not pick io_uring (empty when it did or was not asked).
    const std::string& fallback_reason() const { return fallback_reason_; }

    uint64_t submit(std::vector<ReadSpec> specs);
    // Blocks until `batch` is complete (false on timeout; timeout < 0 waits forever) and appends
    // its not yet delivered completions to `out`.
    bool wait(uint64_t batch, double timeout_s, std::vector<CompletionRec>& out);
    void poll(std::vector<CompletionRec>& out);
    size_t cancel(uint64_t batch);
#ifdef FLASH_FAULT_INJECTION
    // Test builds only (DEEPSEEK_FLASH_FAULT_INJECTION=1 at build time): the next `count` reads of
    // `block_id` fail with `err` (when nonzero) or return at most `short_bytes` (when nonzero).
    void inject_fault(int64_t block_id, int err, size_t short_bytes, int count);
    void clear_faults();
#endif
    EngineStats stats() const;
    // Closes cached files no extent in flight uses; the next read reopens them.
    void forget_files();
    // Stops the threads after the reads in flight finish; queued extents complete as -ECANCELED.
    void close();
    bool closed() const { return closed_; }

private:
    struct File;
    struct Extent;
    struct Chunk;
    struct Batch;
    struct Ring;

    std::shared_ptr<File> open_file(const std::string& path, int& err);
    bool carve(Chunk* c);                        // under mu_
    bool on_result(Chunk* c, ssize_t res, std::vector<Extent*>& finished);  // under mu_
    void fail_extent(Extent* e, int err, int64_t at, bool eof);            // under mu_
    void finalize(std::vector<Extent*>& finished);  // outside mu_: crc, then publish
    void prepare_read(Chunk* c, int& fd, iovec& iov, off_t& off) const;
    void ring_loop();
    void thread_loop(Chunk* c);

    std::string backend_;
    std::string fallback_reason_;
    unsigned queue_depth_;
    size_t request_size_;
    unsigned depth_limit_;     // under mu_: reads in flight allowed now (set_shape)
    size_t request_limit_;     // under mu_: size of the reads carved now (set_shape)
    unsigned active_ = 0;      // under mu_: chunks carved and not yet finished
    bool direct_;
    std::atomic<bool> closed_{false};

    mutable std::mutex files_mu_;
    std::unordered_map<std::string, std::shared_ptr<File>> files_;

    mutable std::mutex mu_;
    std::condition_variable work_cv_;   // new extents or stop
    std::condition_variable done_cv_;   // an extent completed
    bool stop_ = false;
    uint64_t next_batch_ = 1;
    std::deque<Extent*> queue_;         // extents with chunks left to issue
    std::map<uint64_t, std::unique_ptr<Batch>> batches_;
#ifdef FLASH_FAULT_INJECTION
    struct Fault {
        int err;
        size_t short_bytes;
        int count;
    };
    std::unordered_map<int64_t, Fault> faults_;
#endif
    EngineStats stats_;

    std::vector<std::unique_ptr<Chunk>> chunks_;
    std::unique_ptr<Ring> ring_;
    std::vector<std::thread> threads_;
};

}  // namespace flash

namespace flash {
// The typed failure a failed completion stands for (FlashIOError or BlockChecksumError).
Failure completion_failure(const CompletionRec& r);
}  // namespace flash
