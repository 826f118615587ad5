// The pieces of an AMX-BF16 GEMM from packed weights that gemm_q4_amx and gemm_q8_amx share:
// the tile configuration, x rounded to bf16 in A-tile order, and one pass of 16 or 32 rows
// over a pair of output tiles. What differs between them (how a weight block becomes a B
// tile, the blocking, the epilogue) stays in each kernel.
// Included where a kernel is built with AMX-BF16 and AVX512-BF16 (Linux), after amx_tiles.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"

namespace pagemill_amx {

constexpr int64_t BF_TILE = 16 * 64;  // bytes of one weight block as a B tile
constexpr int64_t BF_QK = 32;         // inputs per weight block (and per A tile row)

// Tiles: 0..3 products (2 blocks of 16 rows of x by 2 tiles of 16 outputs), 4, 5 x (16 rows
// x 32 bf16), 6, 7 weights (16 rows of 2 inputs x 16 outputs).
inline void configure_bf16_tiles() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    load_tile_config(cfg);
}

// The products of 16 (ONE) or 32 rows of x (xa: their A tiles, [nb][32 rows][32 inputs] in
// bf16) with one pair's B tiles (bp: [nb][2][BF_TILE]) over blocks [b0, b1), added to c
// ([4][16 x 16] fp32: rows 0-15 x tile 0, x tile 1, rows 16-31 x tile 0, x tile 1) unless
// `first`, then stored to c. `feed.tick()` after each block lets the kernel make upcoming B
// tiles between the tile instructions.
template <bool ONE, typename Feed>
inline void bf16_pass(const uint16_t* xa, const uint8_t* bp, int64_t b0, int64_t b1,
                      bool first, float* c, Feed& feed) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        if (!ONE) {
            _tile_zero(2);
            _tile_zero(3);
        }
    } else {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + 256, 64);
        if (!ONE) {
            _tile_loadd(2, c + 512, 64);
            _tile_loadd(3, c + 768, 64);
        }
    }
    const uint8_t* xr = reinterpret_cast<const uint8_t*>(xa);
    for (int64_t b = b0; b < b1; ++b) {
        _tile_loadd(4, xr + b * 2 * BF_TILE, 64);
        _tile_loadd(6, bp + 2 * b * BF_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, bp + (2 * b + 1) * BF_TILE, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (!ONE) {
            _tile_loadd(5, xr + (2 * b + 1) * BF_TILE, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        feed.tick();
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (!ONE) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

// Row r of x (dtype 1: bf16, else fp32, rounded to nearest even) into xb as A tiles, each
// block of 32 rows [nb][32 rows][32 inputs] (a tile's rows in 1 KB one after the other: a
// stream the prefetchers follow); rows past m_rows (up to a whole A tile) zero.
inline void bf16_x_tiles(int dtype, const void* x, int64_t x_stride, int64_t m_rows,
                         int64_t nb, int64_t r, uint16_t* xb) {
    uint16_t* dst = xb + (r / 32 * 32 * nb + r % 32) * BF_QK;
    for (int64_t b = 0; b < nb; ++b) {
        uint16_t* d = dst + b * 32 * BF_QK;
        if (r >= m_rows) {
            _mm512_storeu_si512(d, _mm512_setzero_si512());
        } else if (dtype == 1) {
            _mm512_storeu_si512(
                d,
                _mm512_loadu_si512(static_cast<const uint16_t*>(x) + r * x_stride + b * BF_QK));
        } else {
            const float* src = static_cast<const float*>(x) + r * x_stride + b * BF_QK;
            _mm512_storeu_si512(d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                       _mm512_loadu_ps(src + 16), _mm512_loadu_ps(src))));
        }
    }
}

}  // namespace pagemill_amx
