// Python binding of the C++ data plane: thin and declarative; policy lives in Python.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
    m.doc() = "deepseek-flash data plane: IO engine, host arena, crc32c";
}
