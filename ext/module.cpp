// Python binding of the C++ data plane: thin and declarative; policy lives in Python.
//
// Every native failure is a flash::Failure; translate_failure() is the one place it becomes a
// deepseek_flash.errors exception (class looked up by name, fields passed as keywords).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "aligned_writer.h"
#include "crc32c.h"
#include "failure.h"
#include "host_arena.h"
#include "io_engine.h"
#include "pybuffer.h"

namespace py = pybind11;
using flash::PyBuffer;

namespace {

// Buffers at least this large are checksummed with the GIL released.
constexpr size_t kReleaseGil = 256 * 1024;

// The deepseek_flash.errors exception for a failure (not raised).
py::object exception_of(const flash::Failure& f) {
    py::object errors = py::module_::import("deepseek_flash.errors");
    py::object cls = errors.attr(f.cls.c_str());
    py::dict kw;
    if (f.cls == "BlockChecksumError") {
        kw["block_id"] = f.block_id;
        kw["path"] = f.path;
        kw["expected"] = f.expected;
        kw["actual"] = f.actual;
    } else if (f.cls == "ArenaFull") {
        kw["requested"] = f.expected;
        kw["largest_free"] = f.actual;
    } else if (f.cls == "FlashIOError" || f.cls == "ClosedError") {
        kw["errno"] = f.err;
        kw["path"] = f.path;
        kw["offset"] = f.offset;
        kw["block_id"] = f.block_id;
        if (f.eof) kw["eof"] = true;
    } else if (f.cls == "InvalidArgument") {
        kw["errno"] = f.err;
        kw["path"] = f.path;
    }
    return cls(f.message, **kw);
}

void translate_failure(const flash::Failure& f) {
    py::object exc = exception_of(f);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

uint32_t crc_of(py::handle data, uint32_t value, uint32_t (*fn)(const void*, size_t, uint32_t)) {
    PyBuffer buf(data, false);
    if (buf.size() >= kReleaseGil) {
        py::gil_scoped_release nogil;
        return fn(buf.data(), buf.size(), value);
    }
    return fn(buf.data(), buf.size(), value);
}

// A read request as Python builds it; `dest` is any writable contiguous buffer.
struct ReadRequest {
    std::string path;
    uint64_t offset;
    size_t length;
    py::object dest;
    size_t dest_offset;
    int64_t block_id;
    std::optional<uint32_t> expected_crc;
};

// Holds the destination buffer while the engine writes into it. The deleter takes the GIL, so the
// last reference may drop on any thread.
std::shared_ptr<void> hold_dest(const ReadRequest& r, char*& dest) {
    auto* buf = new PyBuffer(r.dest, true);
    std::shared_ptr<void> hold(buf, [](void* p) {
        py::gil_scoped_acquire gil;
        delete static_cast<PyBuffer*>(p);
    });
    if (r.dest_offset > buf->size() || r.length > buf->size() - r.dest_offset)
        throw flash::argument_failure("dest holds " + std::to_string(buf->size()) + " bytes; the read needs " +
                                      std::to_string(r.length) + " at dest_offset " + std::to_string(r.dest_offset),
                                      r.path);
    dest = buf->data() + r.dest_offset;
    return hold;
}

flash::ReadSpec to_spec(const ReadRequest& r) {
    flash::ReadSpec s;
    s.path = r.path;
    s.offset = r.offset;
    s.length = r.length;
    s.block_id = r.block_id;
    s.has_crc = r.expected_crc.has_value();
    s.expected_crc = r.expected_crc.value_or(0);
    s.hold = hold_dest(r, s.dest);
    return s;
}

// Completions cross to Python without the destination hold (released here, GIL held).
py::list to_python(std::vector<flash::CompletionRec>& recs) {
    py::list out;
    for (auto& r : recs) {
        r.hold.reset();
        out.append(py::cast(std::move(r)));
    }
    return out;
}

py::dict engine_stats(const flash::IOEngine& e) {
    flash::EngineStats s = e.stats();
    py::dict d;
    d["backend"] = e.backend();
    d["queue_depth"] = e.queue_depth();
    d["request_size"] = e.request_size();
    d["shape_depth"] = e.shape_depth();
    d["shape_request_size"] = e.shape_request_size();
    d["peak_in_flight"] = s.peak_in_flight;
    d["direct"] = e.direct();
    d["bytes_read"] = s.bytes_read;
    d["extents_done"] = s.extents_done;
    d["extents_failed"] = s.extents_failed;
    d["reads_issued"] = s.reads_issued;
    d["short_reads"] = s.short_reads;
    d["open_files"] = s.open_files;
    return d;
}

py::dict arena_stats(const flash::HostArena& a) {
    py::dict d;
    size_t used = a.used(), largest = a.largest_free(), free_bytes = a.size() - used;
    d["size"] = a.size();
    d["used"] = used;
    d["free"] = free_bytes;
    d["largest_free"] = largest;
    d["free_extents"] = a.free_extents();
    d["allocations"] = a.allocations();
    // External fragmentation: the share of free memory not in the largest free extent.
    d["fragmentation"] = free_bytes ? 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes) : 0.0;
    d["attached"] = a.attached();
    d["fd"] = a.fd();
    return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "deepseek-flash data plane: IO engine, host arena, crc32c";

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const flash::Failure& f) {
            try {
                translate_failure(f);
            } catch (py::error_already_set& e) {
                e.restore();  // deepseek_flash.errors failed to import: report that instead
            }
        } catch (const std::invalid_argument& e) {
            try {
                translate_failure(flash::argument_failure(e.what()));
            } catch (py::error_already_set& err) {
                err.restore();
            }
        }
    });

    m.def("crc32c", [](py::buffer data, uint32_t value) { return crc_of(data, value, flash::crc32c); },
          py::arg("data"), py::arg("value") = 0,
          "CRC-32C (Castagnoli) of a buffer, continuing from `value` (0 to start); SSE4.2 when the CPU "
          "has it. crc32c(b, crc32c(a)) == crc32c(a + b). The GIL is released for large buffers.");
    m.def("crc32c_sw", [](py::buffer data, uint32_t value) { return crc_of(data, value, flash::crc32c_sw); },
          py::arg("data"), py::arg("value") = 0,
          "CRC-32C with the portable slicing-by-8 table (the fallback; tested against crc32c).");
    m.def("hw_crc32c", &flash::hw_crc32c, "True when crc32c uses the SSE4.2 instruction.");

    py::class_<flash::AlignedWriter>(m, "AlignedWriter",
                                     "Sequential writer: O_DIRECT in large aligned chunks written by a "
                                     "background thread (double buffering), buffered where O_DIRECT is "
                                     "refused. The final file length is exactly the bytes written.")
        .def(py::init<const std::string&, bool, size_t>(), py::arg("path"), py::arg("direct") = true,
             py::arg("buffer_size") = size_t(8) << 20,
             "Create or truncate `path`. `buffer_size` (rounded up to 4 KiB, at least 1 MiB) is the "
             "size of each disk write.")
        .def(
            "write",
            [](flash::AlignedWriter& w, py::buffer data) {
                PyBuffer buf(data, false);
                py::gil_scoped_release nogil;
                return w.write(buf.data(), buf.size());
            },
            py::arg("data"), "Append `data`; return the file offset at which it starts.")
        .def("pad_to", &flash::AlignedWriter::pad_to, py::arg("alignment") = 4096,
             py::call_guard<py::gil_scoped_release>(),
             "Zero-fill to the next multiple of `alignment`; return the new offset.")
        .def("tell", &flash::AlignedWriter::tell, "Bytes written so far (the next write's offset).")
        .def("close", &flash::AlignedWriter::close, py::arg("fsync") = true,
             py::call_guard<py::gil_scoped_release>(),
             "Write what is buffered, set the exact length, fsync (unless fsync=False) and close. "
             "Raises FlashIOError for any write error since the last call. Idempotent.")
        .def_property_readonly("direct", &flash::AlignedWriter::direct, "True when O_DIRECT is in use.")
        .def_property_readonly("closed", &flash::AlignedWriter::closed, "True after close().")
        .def_property_readonly("path", &flash::AlignedWriter::path, "The file being written.")
        .def("__enter__", [](py::object self) { return self; }, "Return self.")
        .def(
            "__exit__",
            [](flash::AlignedWriter& w, py::object exc_type, py::object, py::object) {
                py::gil_scoped_release nogil;
                w.close(exc_type.is_none());
            },
            py::arg("exc_type"), py::arg("exc"), py::arg("tb"),
            "Close; fsync only when the block raised nothing.");

    py::class_<flash::HostArena>(m, "HostArena", py::buffer_protocol(),
                                 "Shared host memory (memfd, MAP_SHARED) with an allocator of 4 KiB-aligned "
                                 "regions (best fit, coalescing). Export `fd` to another process (fork or "
                                 "SCM_RIGHTS) and map it there with HostArena.attach(fd, size). Supports the "
                                 "buffer protocol over the whole arena (numpy.frombuffer, torch.frombuffer).")
        .def(py::init<size_t, const std::string&>(), py::arg("size"), py::arg("name") = "deepseek-flash",
             "Create an arena of `size` bytes (a multiple of 4096) backed by a new memfd named `name`.")
        .def_static(
            "attach",
            [](int fd, size_t size) { return std::unique_ptr<flash::HostArena>(flash::HostArena::attach(fd, size)); },
            py::arg("fd"), py::arg("size"),
            "Map an arena exported by another process. The fd is duplicated (the caller may close its "
            "own). An attached arena cannot alloc/free: the creating process owns the allocator.")
        .def_property_readonly("fd", &flash::HostArena::fd, "The memfd; stays open while the arena lives.")
        .def_property_readonly("size", &flash::HostArena::size, "Arena size in bytes.")
        .def_property_readonly("used", &flash::HostArena::used, "Bytes allocated (rounded to 4 KiB).")
        .def_property_readonly(
            "address", [](const flash::HostArena& a) { return reinterpret_cast<uintptr_t>(a.base()); },
            "Base address of the mapping (for cudaHostRegister from Python).")
        .def_property_readonly("attached", &flash::HostArena::attached, "True when mapped with attach().")
        .def("alloc", &flash::HostArena::alloc, py::arg("nbytes"),
             "Allocate a 4 KiB-aligned region of at least `nbytes`; return its offset. Raises ArenaFull "
             "(fields requested, largest_free) when no free extent fits.")
        .def("free", &flash::HostArena::free, py::arg("offset"),
             "Free the region at `offset` (from alloc); neighbouring free extents coalesce. Raises "
             "ArenaError for an offset that is not an allocation.")
        .def("allocation_size", &flash::HostArena::allocation_size, py::arg("offset"),
             "Bytes reserved for the allocation at `offset` (0 when none).")
        .def("largest_free", &flash::HostArena::largest_free, "Size of the largest free extent.")
        .def("stats", &arena_stats,
             "dict: size, used, free, largest_free, free_extents, allocations, fragmentation "
             "(1 - largest_free/free), attached, fd.")
        .def("populate", &flash::HostArena::populate, py::call_guard<py::gil_scoped_release>(),
             "Fault every page in now (MADV_POPULATE_WRITE; a page-touch loop on older kernels) so a "
             "later cudaHostRegister is fast. Returns the method used: 'madvise' or 'touch'.")
        .def(
            "view",
            [](py::object self, size_t offset, size_t length) {
                auto& a = self.cast<flash::HostArena&>();
                if (offset > a.size() || length > a.size() - offset)
                    throw flash::argument_failure("view [" + std::to_string(offset) + ", +" + std::to_string(length) +
                                                  ") is outside the arena of " + std::to_string(a.size()) + " bytes");
                // A slice of a memoryview of the arena: it keeps the arena (and its mapping) alive.
                py::memoryview whole(self);
                return py::memoryview(whole[py::slice(static_cast<py::ssize_t>(offset),
                                                      static_cast<py::ssize_t>(offset + length), 1)]);
            },
            py::arg("offset"), py::arg("length"),
            "Writable zero-copy memoryview of [offset, offset + length); keeps the arena alive.")
        .def("__len__", &flash::HostArena::size, "Arena size in bytes.")
        .def_buffer([](flash::HostArena& a) {
            return py::buffer_info(a.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(a.size())}, {1}, false);
        });

    py::class_<ReadRequest>(m, "ReadRequest", "One extent to read: file bytes [offset, offset + length) "
                                              "into dest[dest_offset:].")
        .def(py::init<std::string, uint64_t, size_t, py::object, size_t, int64_t, std::optional<uint32_t>>(),
             py::arg("path"), py::arg("offset"), py::arg("length"), py::arg("dest"), py::arg("dest_offset") = 0,
             py::arg("block_id") = -1, py::arg("expected_crc") = py::none(),
             "`dest`: a writable contiguous buffer (bytearray, numpy array, memoryview, HostArena). "
             "`expected_crc`: the crc32c to verify as the extent lands.")
        .def_readonly("path", &ReadRequest::path, "File path.")
        .def_readonly("offset", &ReadRequest::offset, "File offset.")
        .def_readonly("length", &ReadRequest::length, "Bytes to read.")
        .def_readonly("dest", &ReadRequest::dest, "Destination buffer.")
        .def_readonly("dest_offset", &ReadRequest::dest_offset, "Offset into dest.")
        .def_readonly("block_id", &ReadRequest::block_id, "Block id (-1 when none), reported on errors.")
        .def_readonly("expected_crc", &ReadRequest::expected_crc, "crc32c to verify, or None.");

    py::class_<flash::CompletionRec>(m, "Completion", "The outcome of one ReadRequest.")
        .def_readonly("batch", &flash::CompletionRec::batch, "Batch id from submit().")
        .def_readonly("index", &flash::CompletionRec::index, "Position of the request in its batch.")
        .def_readonly("block_id", &flash::CompletionRec::block_id, "The request's block id.")
        .def_readonly("status", &flash::CompletionRec::status, "0, or -errno (-EIO at an early end of file, -ECANCELED).")
        .def_readonly("bytes", &flash::CompletionRec::bytes, "Bytes landed in dest.")
        .def_readonly("crc_checked", &flash::CompletionRec::crc_checked, "True when expected_crc was verified.")
        .def_readonly("crc_ok", &flash::CompletionRec::crc_ok, "False only when verified and different.")
        .def_property_readonly(
            "crc", [](const flash::CompletionRec& r) -> py::object { return r.crc_checked ? py::object(py::int_(r.crc)) : py::object(py::none()); },
            "crc32c of the landed bytes when verified, else None.")
        .def_readonly("expected_crc", &flash::CompletionRec::expected_crc, "The requested crc (0 when none).")
        .def_readonly("eof", &flash::CompletionRec::eof, "True when the file ended before the extent did.")
        .def_readonly("path", &flash::CompletionRec::path, "File path.")
        .def_readonly("offset", &flash::CompletionRec::offset, "File offset of the extent.")
        .def_readonly("length", &flash::CompletionRec::length, "Extent length requested.")
        .def_readonly("error_offset", &flash::CompletionRec::error_offset, "File offset of the failed read, -1 when none.")
        .def_property_readonly("ok", [](const flash::CompletionRec& r) { return r.status == 0 && r.crc_ok; },
                               "status == 0 and crc_ok.")
        .def(
            "raise_if_failed",
            [](const flash::CompletionRec& r) {
                if (r.status != 0 || !r.crc_ok) throw flash::completion_failure(r);
            },
            "Raise FlashIOError (errno, path, offset, block_id; eof for a short file) or "
            "BlockChecksumError (block_id, path, expected, actual); no-op when ok.")
        .def(
            "error",
            [](const flash::CompletionRec& r, std::optional<int64_t> block_id) -> py::object {
                if (r.status == 0 && r.crc_ok) return py::none();
                flash::CompletionRec named = r;
                if (block_id) named.block_id = *block_id;
                return exception_of(flash::completion_failure(named));
            },
            py::arg("block_id") = py::none(),
            "The exception raise_if_failed() would raise, not raised; None when ok. `block_id` "
            "names the block in it where the request's block_id was a routing token.")
        .def("__repr__", [](const flash::CompletionRec& r) {
            return "<Completion block_id=" + std::to_string(r.block_id) + " status=" + std::to_string(r.status) +
                   " bytes=" + std::to_string(r.bytes) + " crc_ok=" + (r.crc_ok ? "True" : "False") + ">";
        });

    py::class_<flash::IOEngine> engine(m, "IOEngine",
                                "Batched reads of file extents into caller buffers: io_uring (raw syscalls) "
                                "or a preadv thread pool, O_DIRECT where aligned, queue_depth reads in "
                                "flight, extents split into request_size chunks.");
    engine
        .def(py::init<const std::string&, unsigned, size_t, bool>(), py::arg("backend") = "auto",
             py::arg("queue_depth") = 32, py::arg("request_size") = size_t(1) << 20, py::arg("direct") = true,
             "backend: 'auto' (io_uring, else threads), 'io_uring' (raises FlashIOError when the kernel "
             "refuses) or 'threads'. request_size: a multiple of 4096.")
        .def_property_readonly("backend", &flash::IOEngine::backend, "'io_uring' or 'threads'.")
        .def_property_readonly("fallback_reason", &flash::IOEngine::fallback_reason,
                               "Why 'auto' chose threads ('' otherwise).")
        .def_property_readonly("queue_depth", &flash::IOEngine::queue_depth, "Reads kept in flight.")
        .def_property_readonly("request_size", &flash::IOEngine::request_size, "Largest single read.")
        .def_property_readonly("direct", &flash::IOEngine::direct, "O_DIRECT requested.")
        .def_property_readonly("closed", &flash::IOEngine::closed, "True after close().")
        .def_property_readonly("shape", [](const flash::IOEngine& e) {
                return py::make_tuple(e.shape_depth(), e.shape_request_size());
            }, "(depth, request_size) of the reads issued now (set_shape; at first queue_depth, request_size).")
        .def("set_shape", &flash::IOEngine::set_shape, py::arg("depth"), py::arg("request_size"),
             "From now on keep at most `depth` reads in flight (1..queue_depth) of at most `request_size` "
             "bytes (a positive multiple of 4096, <= 1 GiB); reads in flight finish as issued. Raises "
             "InvalidArgument otherwise.")
        .def(
            "submit",
            [](flash::IOEngine& e, const std::vector<ReadRequest>& reqs) {
                std::vector<flash::ReadSpec> specs;
                specs.reserve(reqs.size());
                for (auto& r : reqs) specs.push_back(to_spec(r));
                py::gil_scoped_release nogil;
                return e.submit(std::move(specs));
            },
            py::arg("requests"),
            "Queue a list of ReadRequest; return the batch id. Per-extent failures (missing file, IO "
            "error) arrive as completions, not exceptions.")
        .def(
            "wait",
            [](flash::IOEngine& e, uint64_t batch, std::optional<double> timeout) {
                std::vector<flash::CompletionRec> recs;
                bool done;
                {
                    py::gil_scoped_release nogil;
                    done = e.wait(batch, timeout ? std::max(0.0, *timeout) : -1.0, recs);
                }
                if (!done) {
                    PyErr_SetString(PyExc_TimeoutError, ("batch " + std::to_string(batch) + " not complete").c_str());
                    throw py::error_already_set();
                }
                return to_python(recs);
            },
            py::arg("batch"), py::arg("timeout") = py::none(),
            "Block (GIL released) until every extent of `batch` completed; return its completions not "
            "yet returned by poll(), in request order. Raises TimeoutError (batch still pending).")
        .def(
            "poll",
            [](flash::IOEngine& e) {
                std::vector<flash::CompletionRec> recs;
                e.poll(recs);
                return to_python(recs);
            },
            "Completions of any batch finished since the last call, without blocking.")
        .def("cancel", &flash::IOEngine::cancel, py::arg("batch"), py::call_guard<py::gil_scoped_release>(),
             "Cancel the extents of `batch` not yet fully issued (they complete with -ECANCELED); return "
             "how many.")
        .def(
            "read",
            [](flash::IOEngine& e, const std::string& path, uint64_t offset, size_t length, py::object dest,
               size_t dest_offset, int64_t block_id, std::optional<uint32_t> expected_crc) {
                std::vector<flash::ReadSpec> specs;
                specs.push_back(to_spec(ReadRequest{path, offset, length, dest, dest_offset, block_id, expected_crc}));
                std::vector<flash::CompletionRec> recs;
                {
                    py::gil_scoped_release nogil;
                    e.wait(e.submit(std::move(specs)), -1.0, recs);
                }
                for (auto& r : recs) r.hold.reset();
                if (recs.at(0).status != 0 || !recs[0].crc_ok) throw flash::completion_failure(recs[0]);
            },
            py::arg("path"), py::arg("offset"), py::arg("length"), py::arg("dest"), py::arg("dest_offset") = 0,
            py::arg("block_id") = -1, py::arg("expected_crc") = py::none(),
            "Read one extent synchronously (GIL released). Raises FlashIOError or BlockChecksumError.")
        .def("forget_files", &flash::IOEngine::forget_files,
             "Close the cached file descriptors (reads in flight keep theirs); paths reopen on next use.")
        .def("stats", &engine_stats,
             "dict: backend, queue_depth, request_size, shape_depth, shape_request_size, peak_in_flight "
             "(most reads in flight at once since start or the last set_shape), direct, bytes_read, "
             "extents_done, extents_failed, reads_issued, short_reads, open_files.")
        .def("close", &flash::IOEngine::close, py::call_guard<py::gil_scoped_release>(),
             "Finish reads in flight, cancel queued ones, stop the threads. Idempotent.")
        .def("__enter__", [](py::object self) { return self; }, "Return self.")
        .def(
            "__exit__",
            [](flash::IOEngine& e, py::object, py::object, py::object) {
                py::gil_scoped_release nogil;
                e.close();
            },
            py::arg("exc_type"), py::arg("exc"), py::arg("tb"), "Close.");

#ifdef FLASH_FAULT_INJECTION
    // Test builds only (DEEPSEEK_FLASH_FAULT_INJECTION=1 when building): nothing in a production
    // build -- the daemon's -- can make a read fail on purpose.
    m.attr("fault_injection") = true;
    engine
        .def(
            "inject_fault",
            [](flash::IOEngine& e, int64_t block_id, int err, size_t short_bytes, int count) {
                if (!err && !short_bytes) throw flash::argument_failure("inject_fault needs errno or short");
                e.inject_fault(block_id, err, short_bytes, count);
            },
            py::arg("block_id"), py::arg("errno") = 0, py::arg("short") = 0, py::arg("count") = 1,
            "Test builds only: the next `count` reads of `block_id` fail with `errno`, or return at most "
            "`short` bytes (then the engine continues the read).")
        .def("clear_faults", &flash::IOEngine::clear_faults, "Remove every injected fault.");
#else
    m.attr("fault_injection") = false;
#endif
}
