// Sequential file writer: O_DIRECT in large aligned chunks written by a background thread while
// the caller fills the next buffer; buffered fallback where the file system refuses O_DIRECT.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace flash {

class AlignedWriter {
public:
    static constexpr size_t kAlign = 4096;

    // Creates or truncates `path`. `buffer_size` is rounded up to 4 KiB (at least 1 MiB).
    AlignedWriter(const std::string& path, bool direct, size_t buffer_size);
    ~AlignedWriter();
    AlignedWriter(const AlignedWriter&) = delete;
    AlignedWriter& operator=(const AlignedWriter&) = delete;

    // Appends; returns the file offset at which `data` starts.
    uint64_t write(const void* data, size_t len);
    // Zero-fills up to the next multiple of `alignment`; returns the new offset.
    uint64_t pad_to(size_t alignment);
    uint64_t tell() const { return offset_; }
    // Writes what is buffered, sets the exact length, optionally fsyncs, closes. Idempotent.
    void close(bool do_fsync);

    bool direct() const { return direct_; }
    bool closed() const { return fd_ < 0; }
    const std::string& path() const { return path_; }

private:
    struct Buffer {
        char* data = nullptr;
        size_t fill = 0;
        uint64_t file_offset = 0;
        bool pending = false;  // handed to the writer thread, not yet written
    };

    void append(const void* data, size_t len);
    void hand_off();               // queue the current buffer, move to the next free one
    void drain();                  // wait until the writer thread has written everything
    void writer_loop();
    void write_fully(const char* data, size_t len, uint64_t offset);
    void rethrow_if_failed();
    void stop_thread();

    std::string path_;
    int fd_ = -1;
    bool direct_ = false;
    size_t buffer_size_;
    uint64_t offset_ = 0;          // logical bytes written so far
    std::vector<Buffer> buffers_;
    size_t current_ = 0;
    size_t next_to_write_ = 0;

    std::mutex api_mu_;            // one caller at a time (the GIL is released in write)
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    bool failed_ = false;
    int fail_errno_ = 0;
    uint64_t fail_offset_ = 0;
    std::thread thread_;
};

}  // namespace flash
