// A failure that crosses into Python as a typed deepseek_flash.errors exception.
//
// Native code throws flash::Failure (never aborts); the binding converts it in one place
// (module.cpp: translate_failure) into the named class with keyword fields.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

namespace flash {

struct Failure : std::exception {
    std::string cls;        // class name in deepseek_flash.errors
    std::string message;
    int err = 0;            // errno (0 when not an OS error)
    std::string path;
    int64_t offset = -1;
    int64_t block_id = -1;
    int64_t expected = -1;  // BlockChecksumError: crc; ArenaFull: requested bytes
    int64_t actual = -1;    // BlockChecksumError: crc; ArenaFull: largest free extent
    bool eof = false;       // FlashIOError: the file ended before the extent (a short file)

    const char* what() const noexcept override { return message.c_str(); }
};

inline Failure io_failure(int err, const std::string& path, int64_t offset, int64_t block_id,
                          const std::string& doing) {
    Failure f;
    f.cls = "FlashIOError";
    f.err = err;
    f.path = path;
    f.offset = offset;
    f.block_id = block_id;
    f.message = doing + " " + path + " at offset " + std::to_string(offset) +
                (block_id >= 0 ? " (block " + std::to_string(block_id) + ")" : std::string()) +
                ": " + (err ? std::strerror(err) : "error") + " [errno " + std::to_string(err) + "]";
    return f;
}

// A bad argument (InvalidArgument, errno EINVAL); `path` names the file concerned, if any.
inline Failure argument_failure(const std::string& message, const std::string& path = std::string()) {
    Failure f;
    f.cls = "InvalidArgument";
    f.err = EINVAL;
    f.path = path;
    f.message = message + (path.empty() ? std::string() : " (" + path + ")") + " [errno " + std::to_string(EINVAL) + "]";
    return f;
}

// A call on an object already closed (ClosedError, errno EBADF); `path` names its file, if any.
inline Failure closed_failure(const std::string& what, const std::string& path = std::string()) {
    Failure f;
    f.cls = "ClosedError";
    f.err = EBADF;
    f.path = path;
    f.message = what + " is closed" + (path.empty() ? std::string() : ": " + path) + " [errno " +
                std::to_string(EBADF) + "]";
    return f;
}

inline Failure simple_failure(const char* cls, const std::string& message) {
    Failure f;
    f.cls = cls;
    f.message = message;
    return f;
}

}  // namespace flash
