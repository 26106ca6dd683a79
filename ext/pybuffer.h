// RAII hold on a Python buffer (bytes, bytearray, memoryview, numpy array, mmap, HostArena):
// contiguous bytes, optionally writable. Construct and destroy with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <stdexcept>
#include <utility>

namespace flash {

class PyBuffer {
public:
    PyBuffer() = default;
    PyBuffer(pybind11::handle obj, bool writable) {
        int flags = PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw pybind11::error_already_set();
        held_ = true;
    }
    ~PyBuffer() { release(); }
    PyBuffer(PyBuffer&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
    PyBuffer& operator=(PyBuffer&& o) noexcept {
        if (this != &o) {
            release();
            view_ = o.view_;
            held_ = o.held_;
            o.held_ = false;
        }
        return *this;
    }
    PyBuffer(const PyBuffer&) = delete;
    PyBuffer& operator=(const PyBuffer&) = delete;

    void release() {
        if (held_) PyBuffer_Release(&view_);
        held_ = false;
    }
    char* data() const { return static_cast<char*>(view_.buf); }
    size_t size() const { return static_cast<size_t>(view_.len); }

private:
    Py_buffer view_{};
    bool held_ = false;
};

}  // namespace flash
