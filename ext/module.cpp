// Python binding of the C++ data plane: thin and declarative; policy lives in Python.
//
// Every native failure is a flash::Failure; translate_failure() is the one place it becomes a
// deepseek_flash.errors exception (class looked up by name, fields passed as keywords).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "aligned_writer.h"
#include "crc32c.h"
#include "failure.h"
#include "pybuffer.h"

namespace py = pybind11;
using flash::PyBuffer;

namespace {

// Buffers at least this large are checksummed with the GIL released.
constexpr size_t kReleaseGil = 256 * 1024;

void translate_failure(const flash::Failure& f) {
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
    } else if (f.cls == "FlashIOError") {
        kw["errno"] = f.err;
        kw["path"] = f.path;
        kw["offset"] = f.offset;
        kw["block_id"] = f.block_id;
    }
    py::object exc = cls(f.message, **kw);
    PyErr_SetObject(cls.ptr(), exc.ptr());
}

uint32_t crc_of(py::handle data, uint32_t value, uint32_t (*fn)(const void*, size_t, uint32_t)) {
    PyBuffer buf(data, false);
    if (buf.size() >= kReleaseGil) {
        py::gil_scoped_release nogil;
        return fn(buf.data(), buf.size(), value);
    }
    return fn(buf.data(), buf.size(), value);
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
}
