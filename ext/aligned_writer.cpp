// Sequential file writer: O_DIRECT in large aligned chunks written by a background thread while
// the caller fills the next buffer; buffered fallback where the file system refuses O_DIRECT.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include "aligned_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "failure.h"

namespace flash {
namespace {

// Three buffers: one being filled, one being written, one spare so a burst of small writes
// does not wait for the disk.
constexpr size_t kBuffers = 3;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

AlignedWriter::AlignedWriter(const std::string& path, bool direct, size_t buffer_size)
    : path_(path), buffer_size_(round_up(buffer_size < (1u << 20) ? (1u << 20) : buffer_size, kAlign)) {
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (direct) {
        fd_ = ::open(path.c_str(), flags | O_DIRECT, 0644);
        // tmpfs and some FUSE file systems refuse O_DIRECT with EINVAL: write through the page cache.
        if (fd_ >= 0) direct_ = true;
        else if (errno != EINVAL) throw io_failure(errno, path, 0, -1, "cannot create");
    }
    if (fd_ < 0) {
        fd_ = ::open(path.c_str(), flags, 0644);
        if (fd_ < 0) throw io_failure(errno, path, 0, -1, "cannot create");
    }
    buffers_.resize(kBuffers);
    for (auto& b : buffers_) {
        if (posix_memalign(reinterpret_cast<void**>(&b.data), kAlign, buffer_size_) != 0) {
            for (auto& o : buffers_) std::free(o.data);
            ::close(fd_);
            fd_ = -1;
            throw std::bad_alloc();
        }
    }
    thread_ = std::thread([this] { writer_loop(); });
}

AlignedWriter::~AlignedWriter() {
    try {
        close(false);
    } catch (...) {
        // A destructor cannot report; an explicit close() is where write errors surface.
    }
    stop_thread();
    if (fd_ >= 0) ::close(fd_);
    for (auto& b : buffers_) std::free(b.data);
}

void AlignedWriter::stop_thread() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

void AlignedWriter::write_fully(const char* data, size_t len, uint64_t offset) {
    while (len) {
        ssize_t n = ::pwrite(fd_, data, len, static_cast<off_t>(offset));
        if (n < 0) {
            if (errno == EINTR) continue;
            throw io_failure(errno, path_, static_cast<int64_t>(offset), -1, "cannot write");
        }
        if (n == 0) throw io_failure(EIO, path_, static_cast<int64_t>(offset), -1, "cannot write");
        data += n;
        len -= static_cast<size_t>(n);
        offset += static_cast<uint64_t>(n);
    }
}

void AlignedWriter::writer_loop() {
    for (;;) {
        Buffer* b;
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return stop_ || buffers_[next_to_write_].pending; });
            if (!buffers_[next_to_write_].pending) return;  // stopping with nothing queued
            b = &buffers_[next_to_write_];
        }
        if (!failed_) {
            try {
                write_fully(b->data, b->fill, b->file_offset);
            } catch (const Failure& f) {
                std::lock_guard<std::mutex> lk(mu_);
                failed_ = true;
                fail_errno_ = f.err;
                fail_offset_ = static_cast<uint64_t>(f.offset);
            }
        }
        {
            std::lock_guard<std::mutex> lk(mu_);
            b->pending = false;
            b->fill = 0;
            next_to_write_ = (next_to_write_ + 1) % buffers_.size();
        }
        cv_.notify_all();
    }
}

void AlignedWriter::rethrow_if_failed() {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) throw io_failure(fail_errno_, path_, static_cast<int64_t>(fail_offset_), -1, "cannot write");
}

void AlignedWriter::hand_off() {
    std::unique_lock<std::mutex> lk(mu_);
    buffers_[current_].pending = true;
    cv_.notify_all();
    current_ = (current_ + 1) % buffers_.size();
    cv_.wait(lk, [&] { return !buffers_[current_].pending; });
    buffers_[current_].fill = 0;
    buffers_[current_].file_offset = offset_;
}

void AlignedWriter::drain() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] {
        for (auto& b : buffers_)
            if (b.pending) return false;
        return true;
    });
}

void AlignedWriter::append(const void* data, size_t len) {
    auto src = static_cast<const char*>(data);
    while (len) {
        Buffer& b = buffers_[current_];
        if (b.fill == 0) b.file_offset = offset_;
        size_t n = std::min(len, buffer_size_ - b.fill);
        std::memcpy(b.data + b.fill, src, n);
        b.fill += n;
        offset_ += n;
        src += n;
        len -= n;
        if (b.fill == buffer_size_) hand_off();
    }
}

uint64_t AlignedWriter::write(const void* data, size_t len) {
    std::lock_guard<std::mutex> api(api_mu_);
    if (fd_ < 0) throw closed_failure("AlignedWriter", path_);
    rethrow_if_failed();
    uint64_t start = offset_;
    append(data, len);
    return start;
}

uint64_t AlignedWriter::pad_to(size_t alignment) {
    if (alignment == 0) throw argument_failure("pad_to: alignment must be positive", path_);
    std::lock_guard<std::mutex> api(api_mu_);
    if (fd_ < 0) throw closed_failure("AlignedWriter", path_);
    rethrow_if_failed();
    static const char zeros[kAlign] = {};
    size_t pad = (alignment - offset_ % alignment) % alignment;
    while (pad) {
        size_t n = std::min(pad, sizeof(zeros));
        append(zeros, n);
        pad -= n;
    }
    return offset_;
}

void AlignedWriter::close(bool do_fsync) {
    std::lock_guard<std::mutex> api(api_mu_);
    if (fd_ < 0) return;
    Buffer& b = buffers_[current_];
    size_t tail = b.fill;
    if (tail) {
        // O_DIRECT needs whole sectors: write the last buffer zero-padded to 4 KiB, then cut the
        // file back to the exact length below.
        size_t padded = direct_ ? round_up(tail, kAlign) : tail;
        std::memset(b.data + tail, 0, padded - tail);
        b.fill = padded;
        std::unique_lock<std::mutex> lk(mu_);
        b.pending = true;
        cv_.notify_all();
    }
    drain();
    stop_thread();
    int fd = fd_;
    fd_ = -1;
    auto fail = [&](int err, const char* what) {
        ::close(fd);
        return io_failure(err, path_, static_cast<int64_t>(offset_), -1, what);
    };
    if (failed_) throw fail(fail_errno_, "cannot write");
    if (direct_ && ::ftruncate(fd, static_cast<off_t>(offset_)) != 0) throw fail(errno, "cannot truncate");
    if (do_fsync && ::fsync(fd) != 0) throw fail(errno, "cannot fsync");
    if (::close(fd) != 0) throw io_failure(errno, path_, static_cast<int64_t>(offset_), -1, "cannot close");
}

}  // namespace flash
