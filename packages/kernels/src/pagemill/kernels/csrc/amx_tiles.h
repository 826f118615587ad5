// The AMX tile state the CPU kernels share (gemv_q4, gemv_q8, prefill): whether this CPU and
// this process may use the tiles, and the 64-byte tile configuration with its load.
// Included where a kernel is built with AMX (-march=native on an AMX CPU, Linux).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagemill_amx {

// CPUID.(EAX=7, ECX=0):EDX bits.
constexpr unsigned BF16 = 1u << 22;
constexpr unsigned TILE = 1u << 24;
constexpr unsigned INT8 = 1u << 25;

// The tiles' state needs the kernel's permission once per process (arch_prctl).
inline bool tile_permission() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
        constexpr long XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

// Whether the CPU has every AMX feature in `need` and the process may use the tiles.
inline bool usable(unsigned need) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return (d & need) == need && tile_permission();
}

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// LDTILECFG faults on nonzero reserved bytes, and GCC's intrinsic does not tell the compiler
// that it reads all 64 bytes: without the barrier the zeroing of the unused entries can be
// dropped as dead stores.
inline void load_tile_config(TileConfig& cfg) {
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

}  // namespace pagemill_amx
