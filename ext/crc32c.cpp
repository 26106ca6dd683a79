// CRC-32C (Castagnoli): SSE4.2 instruction when the CPU has it, slicing-by-8 table otherwise.
#include <cstdint>
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define FLASH_X86 1
#endif

namespace flash {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++)
            for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};

const Tables& tables() {
    static const Tables tab;
    return tab;
}

uint32_t sw_update(uint32_t crc, const uint8_t* p, size_t len) {
    const auto& t = tables().t;
    while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
        crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
        len--;
    }
    while (len >= 8) {
        uint64_t word;
        std::memcpy(&word, p, 8);  // little-endian x86/arm64
        word ^= crc;
        crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
              t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
              t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#ifdef FLASH_X86
// Compiled for SSE4.2 only here, so the module still loads on a CPU without it.
__attribute__((target("sse4.2"))) uint32_t hw_update(uint32_t crc, const uint8_t* p, size_t len) {
    uint64_t c = crc;
    while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
        c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t word;
        std::memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    while (len--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

bool detect_hw() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

bool hw_crc32c() {
#ifdef FLASH_X86
    static const bool has = detect_hw();
    return has;
#else
    return false;
#endif
}

uint32_t crc32c_sw(const void* data, size_t len, uint32_t value) {
    return ~sw_update(~value, static_cast<const uint8_t*>(data), len);
}

uint32_t crc32c(const void* data, size_t len, uint32_t value) {
#ifdef FLASH_X86
    if (hw_crc32c()) return ~hw_update(~value, static_cast<const uint8_t*>(data), len);
#endif
    return crc32c_sw(data, len, value);
}

}  // namespace flash
