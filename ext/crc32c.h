// CRC-32C (Castagnoli): SSE4.2 instruction when the CPU has it, slicing-by-8 table otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flash {

// `value` is a previous result to continue from (0 to start): crc32c(b, crc32c(a)) == crc32c(a+b).
uint32_t crc32c(const void* data, size_t len, uint32_t value = 0);
uint32_t crc32c_sw(const void* data, size_t len, uint32_t value = 0);
bool hw_crc32c();

}  // namespace flash
