// IO engine: batched reads of (path, offset, length) extents into caller memory, io_uring (raw
// syscalls, no liburing) or a preadv thread pool.
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>
#include "io_engine.h"

#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "crc32c.h"
#include "failure.h"

namespace flash {

// ---- files ---------------------------------------------------------------------------------

// One path opened once: an O_DIRECT descriptor (when the file system allows it) and a buffered one
// for misaligned heads and for continuing a short read that ended off a 4 KiB boundary.
struct IOEngine::File {
    std::string path;
    int fd_direct = -1;
    int fd_buffered = -1;
    dev_t dev = 0;
    ino_t ino = 0;
    ~File() {
        if (fd_direct >= 0) ::close(fd_direct);
        if (fd_buffered >= 0) ::close(fd_buffered);
    }
};

std::shared_ptr<IOEngine::File> IOEngine::open_file(const std::string& path, int& err) {
    err = 0;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
        err = errno;
        return nullptr;
    }
    std::lock_guard<std::mutex> lk(files_mu_);
    auto it = files_.find(path);
    // A store rewritten by repair/defrag is renamed over the old path: a new inode means reopen.
    if (it != files_.end() && it->second->dev == st.st_dev && it->second->ino == st.st_ino) return it->second;
    auto f = std::make_shared<File>();
    f->path = path;
    f->fd_buffered = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd_buffered < 0) {
        err = errno;
        return nullptr;
    }
    struct stat fst;
    if (::fstat(f->fd_buffered, &fst) != 0) {
        err = errno;
        return nullptr;
    }
    f->dev = fst.st_dev;
    f->ino = fst.st_ino;
    if (direct_) f->fd_direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // EINVAL: tmpfs etc.
    files_[path] = f;
    return f;
}

void IOEngine::forget_files() {
    std::lock_guard<std::mutex> lk(files_mu_);
    files_.clear();  // extents in flight hold their own reference
}

// ---- bookkeeping -----------------------------------------------------------------------------

struct IOEngine::Extent {
    uint64_t batch = 0;
    size_t index = 0;
    ReadSpec spec;
    std::shared_ptr<File> file;
    bool use_direct = false;
    uint64_t next = 0;      // bytes of the extent already handed to chunks
    uint64_t body_end = 0;  // direct: read straight into dest up to here; the rest via a bounce page
    unsigned outstanding = 0;
    int status = 0;
    bool eof = false;
    bool cancelled = false;
    int64_t error_offset = -1;
    uint64_t bytes = 0;
    bool carving_done() const { return status != 0 || cancelled || next >= spec.length; }
};

struct IOEngine::Chunk {
    Extent* ext = nullptr;
    uint64_t rel = 0;   // start within the extent
    size_t need = 0;    // bytes the extent takes from this chunk
    size_t done = 0;    // bytes read so far
    bool bounce = false;
    char* bounce_page = nullptr;
    iovec iov{};        // io_uring keeps a pointer to it until the read completes
    ~Chunk() { std::free(bounce_page); }
};

struct IOEngine::Batch {
    std::vector<std::unique_ptr<Extent>> extents;
    size_t remaining = 0;        // extents not yet complete
    size_t undelivered = 0;      // completions not yet handed to the caller
    std::vector<CompletionRec> ready;
};

// ---- io_uring through raw syscalls -------------------------------------------------------------

struct IOEngine::Ring {
    int fd = -1;
    void* sq_ptr = nullptr;
    size_t sq_len = 0;
    void* cq_ptr = nullptr;
    size_t cq_len = 0;
    io_uring_sqe* sqes = nullptr;
    size_t sqes_len = 0;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    io_uring_cqe* cqes;

    ~Ring() {
        if (sqes) ::munmap(sqes, sqes_len);
        if (cq_ptr && cq_ptr != sq_ptr) ::munmap(cq_ptr, cq_len);
        if (sq_ptr) ::munmap(sq_ptr, sq_len);
        if (fd >= 0) ::close(fd);
    }

    // Returns 0 or an errno (ENOSYS: kernel without io_uring; EPERM: disabled by sysctl/seccomp).
    int setup(unsigned entries) {
        io_uring_params p;
        std::memset(&p, 0, sizeof(p));
        int r = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
        if (r < 0) return errno;
        fd = r;
        sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        bool single = p.features & IORING_FEAT_SINGLE_MMAP;
        if (single) sq_len = cq_len = std::max(sq_len, cq_len);
        sq_ptr = ::mmap(nullptr, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
        if (sq_ptr == MAP_FAILED) {
            sq_ptr = nullptr;
            return errno;
        }
        if (single) {
            cq_ptr = sq_ptr;
        } else {
            cq_ptr = ::mmap(nullptr, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
            if (cq_ptr == MAP_FAILED) {
                cq_ptr = nullptr;
                return errno;
            }
        }
        sqes_len = p.sq_entries * sizeof(io_uring_sqe);
        void* s = ::mmap(nullptr, sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
        if (s == MAP_FAILED) return errno;
        sqes = static_cast<io_uring_sqe*>(s);
        auto sq = static_cast<char*>(sq_ptr);
        auto cq = static_cast<char*>(cq_ptr);
        sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
        sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
        sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
        sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
        cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
        cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
        cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
        cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
        return 0;
    }

    // Queues a readv; the caller never has more than queue_depth reads in flight, so the SQ has room.
    void push_readv(int fd_, const iovec* iov, off_t off, uint64_t user_data) {
        unsigned tail = *sq_tail;
        unsigned idx = tail & *sq_mask;
        io_uring_sqe* sqe = &sqes[idx];
        std::memset(sqe, 0, sizeof(*sqe));
        sqe->opcode = IORING_OP_READV;
        sqe->fd = fd_;
        sqe->off = static_cast<uint64_t>(off);
        sqe->addr = reinterpret_cast<uint64_t>(iov);
        sqe->len = 1;
        sqe->user_data = user_data;
        sq_array[idx] = idx;
        __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    }

    // Submits up to `to_submit` queued entries and waits for at least `min_complete` completions.
    // Returns 0 or an errno; `to_submit` is left holding what the kernel did not take yet.
    int enter(unsigned& to_submit, unsigned min_complete) {
        while (true) {
            long r = ::syscall(__NR_io_uring_enter, fd, to_submit, min_complete,
                               min_complete ? IORING_ENTER_GETEVENTS : 0, nullptr, 0);
            if (r >= 0) {
                to_submit -= std::min<unsigned>(to_submit, static_cast<unsigned>(r));
                if (to_submit == 0 || min_complete == 0) return 0;
                min_complete = 0;  // completions are waiting: reap them, then submit the rest
                continue;
            }
            if (errno == EINTR) continue;
            // Completion queue busy: reap first, the entries stay queued for the next call.
            if (errno == EAGAIN || errno == EBUSY) return 0;
            return errno;
        }
    }
};

// ---- engine ------------------------------------------------------------------------------------

IOEngine::IOEngine(const std::string& backend, unsigned queue_depth, size_t request_size, bool direct)
    : queue_depth_(queue_depth), request_size_(request_size), depth_limit_(queue_depth),
      request_limit_(request_size), direct_(direct) {
    if (backend != "auto" && backend != "io_uring" && backend != "threads")
        throw argument_failure("backend must be 'auto', 'io_uring' or 'threads', not '" + backend + "'");
    if (queue_depth < 1 || queue_depth > 4096) throw argument_failure("queue_depth must be in 1..4096");
    if (request_size < kAlign || request_size % kAlign)
        throw argument_failure("request_size must be a positive multiple of 4096");
    for (unsigned i = 0; i < queue_depth; i++) {
        auto c = std::make_unique<Chunk>();
        if (posix_memalign(reinterpret_cast<void**>(&c->bounce_page), kAlign, kAlign) != 0) throw std::bad_alloc();
        chunks_.push_back(std::move(c));
    }
    if (backend != "threads") {
        auto ring = std::make_unique<Ring>();
        int err = ring->setup(queue_depth);
        if (err == 0) {
            ring_ = std::move(ring);
            backend_ = "io_uring";
        } else if (backend == "io_uring") {
            throw io_failure(err, "io_uring_setup", 0, -1, "cannot create ring with");
        } else {
            fallback_reason_ = std::string("io_uring_setup: ") + std::strerror(err);
        }
    }
    if (ring_) {
        threads_.emplace_back([this] { ring_loop(); });
    } else {
        backend_ = "threads";
        for (auto& c : chunks_) threads_.emplace_back([this, ch = c.get()] { thread_loop(ch); });
    }
}

IOEngine::~IOEngine() { close(); }

void IOEngine::close() {
    std::vector<Extent*> finished;
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_ && threads_.empty()) return;
        stop_ = true;
        for (Extent* e : queue_) {
            // An extent whose carving is done (it failed, or was cancelled, with its front still
            // queued) completes when its last read lands -- it may have completed already, its
            // batch even collected: finishing it here again would count it twice.
            if (e->carving_done()) continue;
            e->cancelled = true;
            if (e->outstanding == 0) finished.push_back(e);
        }
        queue_.clear();
    }
    work_cv_.notify_all();
    finalize(finished);
    for (auto& t : threads_) t.join();
    threads_.clear();
    closed_ = true;
    done_cv_.notify_all();
}

uint64_t IOEngine::submit(std::vector<ReadSpec> specs) {
    if (closed_) throw closed_failure("IOEngine");
    auto batch = std::make_unique<Batch>();
    std::vector<Extent*> failed;
    std::unordered_map<std::string, std::pair<std::shared_ptr<File>, int>> opened;
    for (size_t i = 0; i < specs.size(); i++) {
        auto e = std::make_unique<Extent>();
        e->index = i;
        e->spec = std::move(specs[i]);
        auto it = opened.find(e->spec.path);
        if (it == opened.end()) {
            int err = 0;
            auto f = open_file(e->spec.path, err);
            it = opened.emplace(e->spec.path, std::make_pair(f, err)).first;
        }
        e->file = it->second.first;
        if (!e->file) {
            e->status = -it->second.second;
            e->error_offset = static_cast<int64_t>(e->spec.offset);
            failed.push_back(e.get());
        } else {
            bool aligned = e->spec.offset % kAlign == 0 && reinterpret_cast<uintptr_t>(e->spec.dest) % kAlign == 0;
            e->use_direct = e->file->fd_direct >= 0 && aligned;
            e->body_end = e->use_direct ? e->spec.length / kAlign * kAlign : e->spec.length;
        }
        batch->extents.push_back(std::move(e));
    }
    uint64_t id;
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) throw closed_failure("IOEngine");
        id = next_batch_++;
        batch->remaining = batch->undelivered = batch->extents.size();
        for (auto& e : batch->extents) {
            e->batch = id;
            if (e->status == 0 && e->spec.length > 0) queue_.push_back(e.get());
            else if (e->status == 0) failed.push_back(e.get());  // zero length: complete at once
        }
        batches_[id] = std::move(batch);
    }
    work_cv_.notify_all();
    finalize(failed);
    return id;
}

void IOEngine::set_shape(unsigned depth, size_t request_size) {
    if (depth < 1 || depth > queue_depth_)
        throw argument_failure("depth must be in 1.." + std::to_string(queue_depth_) + " (the engine's queue_depth), not " +
                               std::to_string(depth));
    if (request_size < kAlign || request_size % kAlign || request_size > (size_t(1) << 30))
        throw argument_failure("request_size must be a positive multiple of 4096 of at most 1 GiB, not " +
                               std::to_string(request_size));
    {
        std::lock_guard<std::mutex> lk(mu_);
        depth_limit_ = depth;
        request_limit_ = request_size;
        stats_.peak_in_flight = active_;
    }
    work_cv_.notify_all();
}

unsigned IOEngine::shape_depth() const {
    std::lock_guard<std::mutex> lk(mu_);
    return depth_limit_;
}

size_t IOEngine::shape_request_size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return request_limit_;
}

bool IOEngine::carve(Chunk* c) {
    if (active_ >= depth_limit_) return false;
    while (!queue_.empty()) {
        Extent* e = queue_.front();
        if (e->carving_done()) {
            queue_.pop_front();
            continue;
        }
        c->ext = e;
        c->rel = e->next;
        c->done = 0;
        if (e->next < e->body_end) {
            c->need = static_cast<size_t>(std::min<uint64_t>(request_limit_, e->body_end - e->next));
            c->bounce = false;
        } else {
            c->need = static_cast<size_t>(e->spec.length - e->next);  // < 4 KiB: the unaligned tail
            c->bounce = true;
        }
        e->next += c->need;
        e->outstanding++;
        if (e->carving_done()) queue_.pop_front();
        if (++active_ > stats_.peak_in_flight) stats_.peak_in_flight = active_;
        return true;
    }
    return false;
}

void IOEngine::prepare_read(Chunk* c, int& fd, iovec& iov, off_t& off) const {
    Extent* e = c->ext;
    // O_DIRECT needs the file offset, length and memory 4 KiB aligned; a read continued from an
    // unaligned point (short read) uses the buffered descriptor.
    bool direct = e->use_direct && c->done % kAlign == 0;
    fd = direct ? e->file->fd_direct : e->file->fd_buffered;
    off = static_cast<off_t>(e->spec.offset + c->rel + c->done);
    if (c->bounce) {
        iov.iov_base = c->bounce_page + c->done;
        iov.iov_len = (direct ? kAlign : c->need) - c->done;
    } else {
        iov.iov_base = e->spec.dest + c->rel + c->done;
        iov.iov_len = c->need - c->done;
    }
}

void IOEngine::fail_extent(Extent* e, int err, int64_t at, bool eof) {
    if (e->status == 0) {
        e->status = -err;
        e->error_offset = at;
        e->eof = eof;
    }
}

bool IOEngine::on_result(Chunk* c, ssize_t res, std::vector<Extent*>& finished) {
    Extent* e = c->ext;
    stats_.reads_issued++;
#ifdef FLASH_FAULT_INJECTION
    if (!faults_.empty()) {
        auto f = faults_.find(e->spec.block_id);
        if (f != faults_.end() && f->second.count > 0) {
            if (f->second.err) res = -f->second.err;
            else if (f->second.short_bytes && res > static_cast<ssize_t>(f->second.short_bytes))
                res = static_cast<ssize_t>(f->second.short_bytes);
            if (--f->second.count == 0) faults_.erase(f);
        }
    }
#endif
    int64_t at = static_cast<int64_t>(e->spec.offset + c->rel + c->done);
    bool chunk_done = true;
    if (res < 0) {
        if (res == -EINTR || res == -EAGAIN) chunk_done = false;
        else fail_extent(e, static_cast<int>(-res), at, false);
    } else if (res == 0) {
        fail_extent(e, EIO, at, true);
    } else {
        c->done += static_cast<size_t>(res);
        if (c->done < c->need) {
            stats_.short_reads++;
            chunk_done = e->status != 0;  // another chunk of the extent failed: stop here
        } else if (c->bounce) {
            std::memcpy(e->spec.dest + c->rel, c->bounce_page, c->need);
        }
        if (c->done >= c->need) e->bytes += c->need;
    }
    if (!chunk_done) return true;
    c->ext = nullptr;
    active_--;
    if (--e->outstanding == 0 && e->carving_done()) finished.push_back(e);
    return false;
}

void IOEngine::finalize(std::vector<Extent*>& finished) {
    if (finished.empty()) return;
    std::vector<CompletionRec> recs;
    recs.reserve(finished.size());
    for (Extent* e : finished) {
        CompletionRec r;
        r.batch = e->batch;
        r.index = e->index;
        r.block_id = e->spec.block_id;
        r.status = e->status ? e->status : (e->cancelled ? -ECANCELED : 0);
        r.bytes = e->bytes;
        r.eof = e->eof;
        r.path = e->spec.path;
        r.offset = e->spec.offset;
        r.length = e->spec.length;
        r.error_offset = e->error_offset;
        r.expected_crc = e->spec.expected_crc;
        if (r.status == 0 && e->spec.has_crc) {
            // Verified here, on the IO thread, while the next reads are in flight.
            r.crc_checked = true;
            r.crc = crc32c(e->spec.dest, e->spec.length);
            r.crc_ok = r.crc == e->spec.expected_crc;
        }
        r.hold = std::move(e->spec.hold);
        recs.push_back(std::move(r));
    }
    finished.clear();
    {
        std::lock_guard<std::mutex> lk(mu_);
        for (auto& r : recs) {
            stats_.extents_done++;
            if (r.status != 0 || !r.crc_ok) stats_.extents_failed++;
            else stats_.bytes_read += r.bytes;
            auto& b = batches_.at(r.batch);
            b->remaining--;
            b->ready.push_back(std::move(r));
        }
    }
    done_cv_.notify_all();
}

void IOEngine::ring_loop() {
    std::vector<Chunk*> idle;
    for (auto& c : chunks_) idle.push_back(c.get());
    std::vector<Chunk*> to_issue;
    std::vector<Extent*> finished;
    unsigned inflight = 0;      // reads the kernel owns (queued in the SQ or running)
    unsigned unsubmitted = 0;   // pushed to the SQ, not yet taken by io_uring_enter
    try {
        while (true) {
            {
                std::unique_lock<std::mutex> lk(mu_);
                if (inflight == 0 && to_issue.empty())
                    work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
                if (stop_ && inflight == 0 && to_issue.empty()) return;
                while (!idle.empty() && carve(idle.back())) {
                    to_issue.push_back(idle.back());
                    idle.pop_back();
                }
            }
            for (Chunk* c : to_issue) {
                int fd;
                off_t off;
                prepare_read(c, fd, c->iov, off);
                ring_->push_readv(fd, &c->iov, off, reinterpret_cast<uint64_t>(c));
            }
            unsigned n = static_cast<unsigned>(to_issue.size());
            to_issue.clear();
            inflight += n;
            unsubmitted += n;
            int err = ring_->enter(unsubmitted, inflight ? 1 : 0);
            if (err) throw io_failure(err, "io_uring_enter", 0, -1, "ring failed:");
            unsigned head = *ring_->cq_head;
            unsigned tail = __atomic_load_n(ring_->cq_tail, __ATOMIC_ACQUIRE);
            if (head == tail) continue;
            {
                std::lock_guard<std::mutex> lk(mu_);
                for (; head != tail; head++) {
                    io_uring_cqe* cqe = &ring_->cqes[head & *ring_->cq_mask];
                    Chunk* c = reinterpret_cast<Chunk*>(cqe->user_data);
                    inflight--;
                    if (on_result(c, cqe->res, finished)) to_issue.push_back(c);  // continue a short read
                    else idle.push_back(c);
                }
            }
            __atomic_store_n(ring_->cq_head, tail, __ATOMIC_RELEASE);
            finalize(finished);
        }
    } catch (const std::exception& ex) {
        // The ring itself broke (not one read): fail what is in flight and queued rather than hang.
        std::vector<Extent*> dead;
        {
            std::lock_guard<std::mutex> lk(mu_);
            for (auto& kv : batches_)
                for (auto& e : kv.second->extents)
                    if (e->status == 0 && (e->outstanding || !e->carving_done())) {
                        fail_extent(e.get(), EIO, static_cast<int64_t>(e->spec.offset), false);
                        e->outstanding = 0;
                        dead.push_back(e.get());
                    }
            queue_.clear();
            stop_ = true;
        }
        finalize(dead);
    }
}

void IOEngine::thread_loop(Chunk* c) {
    std::vector<Extent*> finished;
    while (true) {
        {
            std::unique_lock<std::mutex> lk(mu_);
            work_cv_.wait(lk, [&] { return stop_ || carve(c); });
            if (!c->ext) return;  // stopping and nothing carved
        }
        bool again = true;
        while (again) {
            int fd;
            iovec iov;
            off_t off;
            prepare_read(c, fd, iov, off);
            ssize_t res = ::preadv(fd, &iov, 1, off);
            if (res < 0) res = -errno;
            std::lock_guard<std::mutex> lk(mu_);
            again = on_result(c, res, finished);
        }
        finalize(finished);
    }
}

bool IOEngine::wait(uint64_t batch, double timeout_s, std::vector<CompletionRec>& out) {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) throw argument_failure("unknown or already collected batch " + std::to_string(batch));
    Batch* b = it->second.get();
    auto ready = [&] { return b->remaining == 0; };
    if (timeout_s < 0) done_cv_.wait(lk, ready);
    else if (!done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) return false;
    std::sort(b->ready.begin(), b->ready.end(),
              [](const CompletionRec& a, const CompletionRec& c) { return a.index < c.index; });
    for (auto& r : b->ready) out.push_back(std::move(r));
    batches_.erase(it);
    return true;
}

void IOEngine::poll(std::vector<CompletionRec>& out) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = batches_.begin(); it != batches_.end();) {
        Batch* b = it->second.get();
        b->undelivered -= b->ready.size();
        for (auto& r : b->ready) out.push_back(std::move(r));
        b->ready.clear();
        if (b->undelivered == 0) it = batches_.erase(it);
        else ++it;
    }
}

size_t IOEngine::cancel(uint64_t batch) {
    std::vector<Extent*> finished;
    size_t n = 0;
    {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = batches_.find(batch);
        if (it == batches_.end()) return 0;
        for (auto& e : it->second->extents) {
            if (e->carving_done()) continue;
            // Reads already in flight land; the extent then completes as cancelled.
            e->cancelled = true;
            n++;
            if (e->outstanding == 0) finished.push_back(e.get());
        }
        queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [](Extent* e) { return e->carving_done(); }),
                     queue_.end());
    }
    finalize(finished);
    return n;
}

#ifdef FLASH_FAULT_INJECTION
void IOEngine::inject_fault(int64_t block_id, int err, size_t short_bytes, int count) {
    std::lock_guard<std::mutex> lk(mu_);
    if (count <= 0) faults_.erase(block_id);
    else faults_[block_id] = Fault{err, short_bytes, count};
}

void IOEngine::clear_faults() {
    std::lock_guard<std::mutex> lk(mu_);
    faults_.clear();
}
#endif

EngineStats IOEngine::stats() const {
    EngineStats s;
    {
        std::lock_guard<std::mutex> lk(mu_);
        s = stats_;
    }
    std::lock_guard<std::mutex> lk(files_mu_);
    s.open_files = files_.size();
    return s;
}

}  // namespace flash

namespace flash {

Failure completion_failure(const CompletionRec& r) {
    if (r.status != 0) {
        int64_t at = r.error_offset >= 0 ? r.error_offset : static_cast<int64_t>(r.offset);
        if (r.eof) {
            Failure f = io_failure(EIO, r.path, at, r.block_id, "unexpected end of file reading");
            f.message += " (extent of " + std::to_string(r.length) + " bytes at offset " + std::to_string(r.offset) +
                         " ends past the file)";
            f.eof = true;
            return f;
        }
        return io_failure(-r.status, r.path, at, r.block_id, r.status == -ECANCELED ? "cancelled read of" : "cannot read");
    }
    char buf[160];
    std::snprintf(buf, sizeof(buf), ": crc32c 0x%08x, expected 0x%08x", r.crc, r.expected_crc);
    Failure f;
    f.cls = "BlockChecksumError";
    f.message = "block " + std::to_string(r.block_id) + " in " + r.path + " at offset " + std::to_string(r.offset) + buf;
    f.block_id = r.block_id;
    f.path = r.path;
    f.offset = static_cast<int64_t>(r.offset);
    f.expected = r.expected_crc;
    f.actual = r.crc;
    return f;
}

}  // namespace flash
