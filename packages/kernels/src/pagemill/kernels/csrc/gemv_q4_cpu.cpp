// y[M, N] = x[M, K] · W[N, K]ᵀ over 4-bit weight blocks, with the activations quantized to
// int8 per block of 32 and the dot products done in integers (the way llama.cpp runs Q4_1
// against Q8_1). A few rows of x (decode steps) are bound by reading W: each weight block
// is read once, in one stream, with its scales next to it.
//
// Weights come in tiles of 16 output rows; per tile and block of 32 inputs (`S` = uint16_t
// for fp16, or float):
//     S d[16]; S m[16]; uint8_t qs[256];     w[r][j] = d[r] * q[r][j] + m[r]
// with the nibbles ordered so that one 4-byte lane holds 4 consecutive inputs of one row
// (see `tile_rows`). fp16 holds GGUF's Q4_0/Q4_1 scales exactly; rows whose scales fp16
// cannot hold (Q4_K's d * sc, requantized rows) use fp32.
//
// Activation block: xq[j] = round(x[j] / dx) in -127..127 with dx = max|x| / 127, plus the
// block's exact float sum sx, so that
//     sum_j x[j] w[j] ≈ d * dx * sum_j q[j] xq[j] + m * sx.
// Only the d term sees the int8 rounding; the min term is exact.
//
// Three builds of the same arithmetic (integer sums are exact in each, so they differ only
// in float summation order): AVX512-VNNI / AVX-VNNI (`vpdpbusd`: u8 × s8 → i32), AVX2
// (`vpmaddubsw`, whose pairs add up in int16 over a block: 8 * 2 * 15 * 127 fits, nothing
// saturates; one `vpmaddwd` per block widens them), plain C++. With two activation planes
// every build sums q1 * 254 + q2 in one integer per block.
// PAGEMILL_GEMV_ISA forces one (0 plain, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI) for tests.
//
// Built at run time by pagemill.kernels.gemv_q4_cpu (host compiler, -O3 -march=native
// -fopenmp, no torch headers) and called through ctypes. Output rows are split over
// OpenMP threads by tiles. The same code serves a decode step (a few rows: bound by
// reading W) and a large batch (bound by the dot products): each row of x is quantized once
// per call into records grouped by blocks of rows (`rec_bytes`), and each weight block,
// unpacked from its nibbles once, meets a block of rows while it is in registers (8 rows
// with one plane on AVX-512, else 4); a tile's weights stay in L1 while every row block
// passes (tiles are the outer loop).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "amx_tiles.h"
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_bf16_gemm.h"
#endif
#endif

#ifndef PAGEMILL_GEMV_ISA
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEMILL_GEMV_ISA 3
#elif defined(__AVXVNNI__)
#define PAGEMILL_GEMV_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEMILL_GEMV_ISA 1
#else
#define PAGEMILL_GEMV_ISA 0
#endif
#endif

namespace {

constexpr int QK = 32;
// Rows of x that share each unpacked weight block while it is in registers: AVX-512 has
// the registers for 8 rows' accumulators beside a block's 8 weight vectors.
constexpr int MAX_TILE = 8;
template <int P>
constexpr int tile_rows_max() {
#if PAGEMILL_GEMV_ISA == 3
    return P == 1 ? 8 : 4;
#else
    return 4;
#endif
}

// Quantized activations, per (block of tile_rows_max rows of x, block of 32 inputs, row):
// P * 32 int8 values, then dx and sx (floats). A row block's records for one input block
// are adjacent, so a tile reaches all its rows from one pointer and constant offsets.
template <int P>
constexpr int64_t rec_bytes() { return P * QK + 2 * static_cast<int64_t>(sizeof(float)); }
template <int P>
constexpr int64_t block_stride() { return tile_rows_max<P>() * rec_bytes<P>(); }

#if PAGEMILL_GEMV_ISA == 3
// acc + w (16 x 4 u8) · x[0..4) (s8) broadcast to every lane, the broadcast folded into the
// instruction's memory operand (compilers emit a separate broadcast for the intrinsic): the
// tiles' loop is bound by how many instructions it issues, not by the dot units.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* x) {
    typedef int32_t int32_any __attribute__((may_alias, aligned(1)));
    __asm__("vpdpbusd %2%{1to16%}, %1, %0"
            : "+v"(acc)
            : "v"(w), "m"(*reinterpret_cast<const int32_any*>(x)));
    return acc;
}
#endif

#if defined(__AVX512F__)
// A block's 16 d and 16 m scales, stored as `S` (fp16 or fp32), as two float vectors.
template <typename S>
inline void load_block_scales(const uint8_t* blk, __m512& d, __m512& m) {
    if constexpr (sizeof(S) == 2) {
        d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    } else {
        d = _mm512_loadu_ps(blk);
        m = _mm512_loadu_ps(blk + 64);
    }
}
#endif

inline float load_float(const uint8_t* p) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
}

constexpr int ROWS = 16;                // output rows interleaved in one tile
constexpr int64_t PREFETCH_BYTES = 8192;  // how far ahead of its loads the AVX2 loop prefetches
constexpr int64_t QS_BYTES = ROWS * QK / 2;  // nibbles of one block of a tile

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

inline float scale_value(uint16_t s) { return half_to_float(s); }
inline float scale_value(float s) { return s; }

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

#if PAGEMILL_GEMV_ISA == 3
// Block b of one row of x: its P int8 planes (32 values each, at q and q + plane_stride),
// dx and the block's sum sx. Shared by the records of `quantize_row` and the row-major planes
// of the AMX kernel, so that both multiply the same integers.
template <int P>
inline void quantize_block(const void* x, int dtype, int64_t b, int8_t* q, int64_t plane_stride,
                           float* dx_out, float* sx_out) {
    // The same rounding as the plain loop below in two 16-lane halves (only sx's summation
    // order differs); a large batch quantizes as many rows as it multiplies.
    __m512 v[2];
    for (int h = 0; h < 2; ++h) {
        const int64_t i = b * QK + 16 * h;
        if (dtype == 1) {
            const __m256i raw = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        } else {
            v[h] = _mm512_loadu_ps(static_cast<const float*>(x) + i);
        }
    }
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int h = 0; h < 2; ++h) {
        const __m512 q1 = _mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q1)));
        if constexpr (P == 2) {
            const __m512 rest = _mm512_sub_ps(v[h], _mm512_mul_ps(q1, _mm512_set1_ps(d)));
            __m512 q2 = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(inv * 254.0f)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q2 = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), q2));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + plane_stride + 16 * h),
                             _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q2)));
        }
    }
    // The AVX-512 tiles sum both planes as q1 * 254 + q2 in one integer.
    *dx_out = P == 2 ? d / 254.0f : d;
    *sx_out = sum;
}
#endif

// One row of x quantized into its records (`rec`: block 0's; see rec_bytes).
template <int P>
void quantize_row(const void* x, int dtype, int64_t k, uint8_t* rec) {
#if PAGEMILL_GEMV_ISA == 3
    for (int64_t b = 0; b < k / QK; ++b) {
        uint8_t* rb = rec + b * block_stride<P>();
        float dx, sx;
        quantize_block<P>(x, dtype, b, reinterpret_cast<int8_t*>(rb), QK, &dx, &sx);
        std::memcpy(rb + P * QK, &dx, sizeof dx);
        std::memcpy(rb + P * QK + sizeof dx, &sx, sizeof sx);
    }
#else
    float buf[QK];
    for (int64_t b = 0; b < k / QK; ++b) {
        for (int j = 0; j < QK; ++j) {
            const int64_t i = b * QK + j;
            buf[j] = dtype == 1 ? bf16_to_float(static_cast<const uint16_t*>(x)[i])
                                : static_cast<const float*>(x)[i];
        }
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QK; ++j) {
            amax = std::max(amax, std::fabs(buf[j]));
            sum += buf[j];
        }
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        uint8_t* rb = rec + b * block_stride<P>();
        int8_t* xb = reinterpret_cast<int8_t*>(rb);
        for (int j = 0; j < QK; ++j) {
            const float q1 = std::nearbyint(buf[j] * inv);
            xb[j] = static_cast<int8_t>(q1);
            if constexpr (P == 2) {
                // The remainder, |r| <= d / 2, in steps of d / 254.
                const float rest = buf[j] - q1 * d;
                const float q2 = std::nearbyint(rest * (inv * 254.0f));
                xb[QK + j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q2)));
            }
        }
        // Two planes' dots meet as q1 * 254 + q2: dx is stored divided by 254.
        const float dx = P == 2 ? d / 254.0f : d;
        std::memcpy(rb + P * QK, &dx, sizeof dx);
        std::memcpy(rb + P * QK + sizeof dx, &sum, sizeof sum);
    }
#endif
}

// One tile of 16 output rows against rows x[0..T) of the tile of activations.
// For each block: 16 d's then 16 m's (S each), then 256 bytes of nibbles laid out so that a
// 4-byte lane holds 4 consecutive inputs of one output row: byte (j, r, t), j < 4, r < 16,
// t < 4, holds q[r][4j + t] in its low nibble and q[r][16 + 4j + t] in its high nibble.
// A u8 x s8 dot of such a vector against 4 inputs of x broadcast to every lane then gives
// each row's partial sum in its own lane: no horizontal sums, and the 16 rows' scales
// apply as one vector.
template <typename S, int T, int P>
void tile_rows(const uint8_t* w, int64_t nb, const uint8_t* xr, float* out /* [T][16] */) {
    constexpr int64_t REC = rec_bytes<P>();
    constexpr int64_t SB = 2 * ROWS * sizeof(S);
    constexpr int64_t BLOCK = SB + QS_BYTES;
#if PAGEMILL_GEMV_ISA == 3
    // A block's 8 weight vectors stay in registers while the T rows of x pass over them;
    // one float accumulator per row (the d and m terms share it).
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        __m512 d, m;
        load_block_scales<S>(blk, d, m);
        __m512i wv[8];
        for (int j = 0; j < 4; ++j) {
            const __m512i raw = _mm512_loadu_si512(blk + SB + 64 * j);
            wv[j] = _mm512_and_si512(raw, low4);
            wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        for (int t = 0; t < T; ++t) {
            const uint8_t* rt = xr + b * block_stride<P>() + t * REC;
            const int8_t* xb = reinterpret_cast<const int8_t*>(rt);
            __m512i q;
            for (int plane = 0; plane < P; ++plane) {
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int i = 0; i < 8; i += 2) {
                    s0 = dpbusd_broadcast(s0, wv[i], xb + plane * QK + 4 * i);
                    s1 = dpbusd_broadcast(s1, wv[i + 1], xb + plane * QK + 4 * i + 4);
                }
                const __m512i sp = _mm512_add_epi32(s0, s1);
                // q1 * 254 + q2 stays below 2^24: exact in the float it becomes.
                q = plane == 0 ? sp
                               : _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(q, 8),
                                                                   _mm512_slli_epi32(q, 1)),
                                                  sp);
            }
            // dx is already divided by 254 for two planes (quantize_row).
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q),
                                     _mm512_mul_ps(d, _mm512_set1_ps(load_float(rt + P * QK))),
                                     acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(load_float(rt + P * QK + 4)), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * ROWS, acc[t]);
#elif PAGEMILL_GEMV_ISA >= 1
    // Two halves of 8 rows in 256-bit vectors, one after the other over all the blocks: a
    // half's 8 weight vectors and T accumulators fit the 16 registers (both halves at once
    // spilled from 4 rows up), and the second half finds the tile in L1.
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; ++h) {
        __m256 acc[T];  // the d and m terms share it
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + b * BLOCK;
            // Into L2, well ahead: the hardware prefetchers alone leave a core's stream short
            // of what the memory gives it while this loop computes.
            for (int64_t l = 0; l < BLOCK; l += 64)
                _mm_prefetch(reinterpret_cast<const char*>(blk) + PREFETCH_BYTES + l,
                             _MM_HINT_T1);
            __m256 d, m;
            if constexpr (sizeof(S) == 2) {
                d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
                m = _mm256_cvtph_ps(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
            } else {
                d = _mm256_loadu_ps(reinterpret_cast<const float*>(blk) + 8 * h);
                m = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 64) + 8 * h);
            }
            __m256i wv[8];
            for (int j = 0; j < 4; ++j) {
                const __m256i raw =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SB + 64 * j + 32 * h));
                wv[j] = _mm256_and_si256(raw, low4);
                wv[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            for (int t = 0; t < T; ++t) {
                const uint8_t* rt = xr + b * block_stride<P>() + t * REC;
                const int8_t* xb0 = reinterpret_cast<const int8_t*>(rt);
                // Both planes' integer sums meet as q1 * 254 + q2 (below 2^24: exact in the
                // float it becomes), as on AVX-512; dx is already divided by 254 for two.
                __m256i q = _mm256_setzero_si256();
                for (int plane = 0; plane < P; ++plane) {
                    const int8_t* xb = xb0 + plane * QK;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#if PAGEMILL_GEMV_ISA == 2
                    for (int i = 0; i < 8; i += 2) {
                        int32_t x0, x1;
                        std::memcpy(&x0, xb + 4 * i, 4);
                        std::memcpy(&x1, xb + 4 * i + 4, 4);
                        s0 = _mm256_dpbusd_avx_epi32(s0, wv[i], _mm256_set1_epi32(x0));
                        s1 = _mm256_dpbusd_avx_epi32(s1, wv[i + 1], _mm256_set1_epi32(x1));
                    }
                    const __m256i sp = _mm256_add_epi32(s0, s1);
                    q = plane == 0 ? sp
                                   : _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(q, 8),
                                                                       _mm256_slli_epi32(q, 1)),
                                                      sp);
#else
                    // The 8 products' pairs add up in 16 bits (8 * 2 * 15 * 127 = 30480
                    // fits), so one vpmaddwd per plane widens them: it also applies the
                    // first plane's factor 254.
                    for (int i = 0; i < 8; i += 2) {
                        int32_t x0, x1;
                        std::memcpy(&x0, xb + 4 * i, 4);
                        std::memcpy(&x1, xb + 4 * i + 4, 4);
                        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[i], _mm256_set1_epi32(x0)));
                        s1 = _mm256_add_epi16(
                            s1, _mm256_maddubs_epi16(wv[i + 1], _mm256_set1_epi32(x1)));
                    }
                    const __m256i f = _mm256_set1_epi16(P == 2 && plane == 0 ? 254 : 1);
                    q = _mm256_add_epi32(q, _mm256_madd_epi16(_mm256_add_epi16(s0, s1), f));
#endif
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q),
                                         _mm256_mul_ps(d, _mm256_set1_ps(load_float(rt + P * QK))),
                                         acc[t]);
                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(load_float(rt + P * QK + 4)), acc[t]);
            }
        }
        for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * ROWS + 8 * h, acc[t]);
    }
#else
    float acc[T][ROWS], mins[T][ROWS];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < ROWS; ++r) acc[t][r] = mins[t][r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        S ds[ROWS], ms[ROWS];
        std::memcpy(ds, blk, sizeof ds);
        std::memcpy(ms, blk + ROWS * sizeof(S), sizeof ms);
        const uint8_t* qs = blk + SB;
        for (int t = 0; t < T; ++t) {
            const uint8_t* rt = xr + b * block_stride<P>() + t * REC;
            for (int r = 0; r < ROWS; ++r) {
                int32_t q = 0;  // q1 * 254 + q2 with two planes, as the SIMD paths
                for (int plane = 0; plane < P; ++plane) {
                    const int8_t* xb = reinterpret_cast<const int8_t*>(rt) + plane * QK;
                    int32_t dot = 0;
                    for (int j = 0; j < 4; ++j) {
                        for (int u = 0; u < 4; ++u) {
                            const uint8_t byte = qs[(j * ROWS + r) * 4 + u];
                            dot += static_cast<int32_t>(byte & 15) * xb[4 * j + u];
                            dot += static_cast<int32_t>(byte >> 4) * xb[16 + 4 * j + u];
                        }
                    }
                    q = plane == 0 ? dot : q * 254 + dot;
                }
                acc[t][r] += static_cast<float>(q) * (scale_value(ds[r]) * load_float(rt + P * QK));
                mins[t][r] += scale_value(ms[r]) * load_float(rt + P * QK + 4);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < ROWS; ++r) out[t * ROWS + r] = acc[t][r] + mins[t][r];
#endif
}

// y[i .. i + rows) = v[0 .. rows), rounded to bf16 (dtype 1) as float_to_bf16 does.
inline void store_outputs(const float* v, void* y, int64_t i, int64_t rows, int dtype) {
#if PAGEMILL_GEMV_ISA == 3
    const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512 f = _mm512_loadu_ps(v);
    if (dtype == 1) {
        // Round to nearest even in the integers; NaNs stay NaN (quiet).
        const __m512i bits = _mm512_castps_si512(f);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, keep, _mm512_cvtepi32_epi16(r));
    } else {
        _mm512_mask_storeu_ps(static_cast<float*>(y) + i, keep, f);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
        if (dtype == 1) {
            static_cast<uint16_t*>(y)[i + r] = float_to_bf16(v[r]);
        } else {
            static_cast<float*>(y)[i + r] = v[r];
        }
    }
#endif
}

// tile_rows for tm (1..MAX_TILE) rows of x.
template <typename S, int P, int T = tile_rows_max<P>()>
void row_block(int64_t tm, const uint8_t* w, int64_t nb, const uint8_t* xr, float* out) {
    if constexpr (T > 1) {
        if (tm < T) return row_block<S, P, T - 1>(tm, w, nb, xr, out);
    }
    tile_rows<S, T, P>(w, nb, xr, out);
}

template <typename S, int P>
void gemv(const uint8_t* w, const uint8_t* recs, void* y, int dtype, int64_t m_rows, int64_t n,
          int64_t k, int64_t y_stride, int threads) {
    constexpr int TM = tile_rows_max<P>();
    const int64_t nb = k / QK;
    const int64_t tiles = (n + ROWS - 1) / ROWS;
    const int64_t tile_bytes = nb * (2 * ROWS * static_cast<int64_t>(sizeof(S)) + QS_BYTES);
    // Tiles outermost: a tile's weights (a few KB) stay in L1 while every row block passes.
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint8_t* wt = w + tile * tile_bytes;
        const int64_t rows = std::min<int64_t>(ROWS, n - tile * ROWS);
        for (int64_t m0 = 0; m0 < m_rows; m0 += TM) {
            float out[MAX_TILE * ROWS];
            const int64_t tm = std::min<int64_t>(TM, m_rows - m0);
            row_block<S, P>(tm, wt, nb, recs + (m0 / TM) * nb * block_stride<P>(), out);
            for (int64_t t = 0; t < tm; ++t)
                store_outputs(out + t * ROWS, y, (m0 + t) * y_stride + tile * ROWS, rows, dtype);
        }
    }
}

template <int P>
void quantize_and_multiply(int dtype, const void* x, int64_t x_stride, const uint8_t* w,
                           int scale_bytes, void* y, int64_t y_stride, int64_t m_rows,
                           int64_t n, int64_t k, int threads) {
    constexpr int TM = tile_rows_max<P>();
    const int64_t nb = k / QK;
    const size_t elt = dtype == 1 ? 2 : 4;
    // Per calling thread, reused: one decode step calls this ~120 times with few rows.
    thread_local std::vector<uint8_t> buffer;
    buffer.resize(static_cast<size_t>((m_rows + TM - 1) / TM * nb * block_stride<P>()));
    // A raw pointer: inside the parallel regions a thread_local name is each thread's own.
    uint8_t* recs = buffer.data();
    const int qthreads = m_rows >= 16 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
    for (int64_t r = 0; r < m_rows; ++r) {
        quantize_row<P>(static_cast<const char*>(x) + r * x_stride * elt, dtype, k,
                        recs + (r / TM) * nb * block_stride<P>() + (r % TM) * rec_bytes<P>());
    }
    if (scale_bytes == 2) {
        gemv<uint16_t, P>(w, recs, y, dtype, m_rows, n, k, y_stride, threads);
    } else {
        gemv<float, P>(w, recs, y, dtype, m_rows, n, k, y_stride, threads);
    }
}


// ---- AMX: the same product on the matrix units (TDPBSUD: s8 x u8 -> i32 tiles) ---------------
//
// For a block of 32 inputs, x's quantized rows are the A tile (up to 16 rows x 32 int8, read
// in place from row-major planes) and the weight block is the B tile: TDPBSUD wants B as K/4 rows
// of 16 columns x 4 consecutive inputs, which is the packed nibble order already (byte
// (j, r, t) holds q[r][4j + t] low and q[r][16 + 4j + t] high), so B's 8 rows are the 4
// 64-byte lines of a block masked (rows 0..3) and shifted (rows 4..7). The product tile
// C[t][r] = sum_j xq[t][j] q[r][j] (16 rows of x by the tile's 16 outputs) leaves the
// matrix unit through memory, and each row then gets exactly the AVX-512 GEMV's float
// steps (acc += float(q) * (d * dx), acc += m * sx, block by block): the two kernels agree
// to the bit. A tile of outputs unpacks its B tiles once and reuses them for every 16 rows
// of x. Two planes: each plane's rows are rows of A (8 rows of x per A tile), and a row's
// two sums meet as q1 * 254 + q2, the GEMV's integer.
//
// The tile instructions' cost goes by the row (loads, TDPBSUD, stores), not by the work per
// weight, so a few rows of x pay for few rows: with two planes the tiles beat the GEMV from a
// handful of rows (`pagemill_gemv_q4` moves to them by itself, AMX_GEMV_ROWS_*), where the
// GEMV's second plane doubles its integer work. What is left per block and row is the float
// scaling, the same as the GEMV's.
//
// The tiles' state needs the kernel's permission once per process (arch_prctl) and a tile
// configuration per thread; without AMX in the build (compiler, -march) or on the machine
// the entry point refuses (status 4) and callers use the GEMV.

#if PAGEMILL_GEMV_ISA == 3 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PAGEMILL_HAVE_AMX 1

using pagemill_amx::load_tile_config;
using pagemill_amx::TileConfig;

bool amx_usable() {
    static const bool ok =
        pagemill_amx::usable(pagemill_amx::BF16 | pagemill_amx::TILE | pagemill_amx::INT8);
    return ok;
}

// Tile roles. A pass multiplies up to 16 rows of x against one tile of outputs, block by
// block, block b + 1's products issued before block b's are scaled. One plane, or two planes
// with at most 8 rows (both planes as the A tile's rows, plane 1 above plane 2, so one product
// tile holds both): one A (x), B (weights) and C (products) tile per block, in two sets,
// {0, 2, 4} and {1, 3, 5}. Two planes with 9..16 rows: A tiles 0, 1 (each half of the rows of
// x with both planes, plane_group), B tile 2, and the product tiles 3, 4 or 5, 6 on
// alternate blocks. The A and C tiles have only as many rows as the pass uses (`a_rows`):
// the tile instructions take time by the row.
void configure_tiles(int na, int a_rows) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(a_rows);
        cfg.colsb[t] = 64;
    }
    cfg.colsb[0] = cfg.colsb[1] = QK;
    cfg.rows[2] = QK / 4;
    if (na == 1) cfg.rows[3] = QK / 4;
    load_tile_config(cfg);
}

constexpr int64_t B_BYTES = QK / 4 * 64;  // one unpacked weight block (B tile)

// Block b's products on the matrix unit into product set S (see configure_tiles); xa: the
// block's A rows (row stride k; the second A tile a1 bytes on), bqb: its B tile. (GCC's tile
// intrinsics paste their tile numbers into the instruction text: literals only.)
template <int NA, int S>
inline void issue_block(const int8_t* xa, int64_t k, int64_t a1, const uint8_t* bqb) {
    if constexpr (NA == 1 && S == 0) {
        _tile_loadd(2, bqb, 64);
        _tile_loadd(0, xa, k);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
    } else if constexpr (NA == 1) {
        _tile_loadd(3, bqb, 64);
        _tile_loadd(1, xa, k);
        _tile_zero(5);
        _tile_dpbsud(5, 1, 3);
    } else if constexpr (S == 0) {
        _tile_loadd(2, bqb, 64);
        _tile_loadd(0, xa, k);
        _tile_zero(3);
        _tile_dpbsud(3, 0, 2);
        _tile_loadd(1, xa + a1, k);
        _tile_zero(4);
        _tile_dpbsud(4, 1, 2);
    } else {
        _tile_loadd(2, bqb, 64);
        _tile_loadd(0, xa, k);
        _tile_zero(5);
        _tile_dpbsud(5, 0, 2);
        _tile_loadd(1, xa + a1, k);
        _tile_zero(6);
        _tile_dpbsud(6, 1, 2);
    }
}

template <int NA, int S>
inline void unload_block(int32_t* c) {
    if constexpr (NA == 1 && S == 0) {
        _tile_stored(4, c, 64);
    } else if constexpr (NA == 1) {
        _tile_stored(5, c, 64);
    } else if constexpr (S == 0) {
        _tile_stored(3, c, 64);
        _tile_stored(4, c + 256, 64);
    } else {
        _tile_stored(5, c, 64);
        _tile_stored(6, c + 256, 64);
    }
}

// Rows of x per A tile of two planes: a pass of all rows (CMP) splits them evenly over its
// A tiles, the passes of larger batches take 8 per tile.
template <int NR, bool CMP>
constexpr int plane_group() {
    return !CMP ? 8 : NR <= 8 ? NR : (NR + 1) / 2;
}

// One block's products (c: NA tiles of 16 x 16 int32) into acc[0 .. NR) with tile_rows'
// float steps. Two planes: with G = plane_group, x row t's plane sums are row t % G of
// product tile t / G and G rows below; q1 * 254 + q2 is exact in floats (below 2^24), so
// the fma gives the GEMV's integer.
template <int P, int NR, bool CMP>
inline void scale_block(const int32_t* c, const float* dm, const float* dxb, const float* sxb,
                        __m512* acc) {
    const __m512 d = _mm512_load_ps(dm), m = _mm512_load_ps(dm + 16);
    // Unrolled, or the accumulators live on the stack.
#pragma GCC unroll 16
    for (int t = 0; t < NR; ++t) {
        __m512 q;
        if constexpr (P == 1) {
            q = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * t));
        } else {
            constexpr int G = plane_group<NR, CMP>();
            const int32_t* c1 = c + 256 * (t / G) + 16 * (t % G);
            q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c1)),
                                _mm512_set1_ps(254.0f),
                                _mm512_cvtepi32_ps(_mm512_load_si512(c1 + 16 * G)));
        }
        acc[t] = _mm512_fmadd_ps(q, _mm512_mul_ps(d, _mm512_set1_ps(dxb[t])), acc[t]);
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sxb[t]), acc[t]);
    }
}

// NR (1..16) rows of x against one tile of outputs into out[NR][16]. xa: the rows' A tiles
// (row stride k: the rows of one plane, or plane_group rows of each of two), dx / sx:
// [nb][m_stride] from the pass's first row, bq / dm: the tile's B tiles and float scales
// (unpack_tile).
template <int P, int NR, bool CMP>
void amx_pass(const int8_t* xa, int64_t k, const float* dx, const float* sx, int64_t m_stride,
              const uint8_t* bq, const float* dm, int64_t nb, float* out) {
    constexpr int NA = P == 1 ? 1 : (NR + 7) / 8;
    alignas(64) int32_t c[2][NA * 256];
    __m512 acc[NR];
#pragma GCC unroll 16
    for (int t = 0; t < NR; ++t) acc[t] = _mm512_setzero_ps();
    // In program order: block b + 1's products are issued and block b - 1's scaled before
    // block b's are stored, so that no step waits for a product just issued. (On Sapphire
    // Rapids the tile instructions and the vector arithmetic do not run at the same time: a
    // block costs its tile work plus its scaling, and what counts is the size of each.)
    // Two A tiles (two planes, 9..16 rows): the second one's A rows start past the first's.
    const int64_t a1 = 2 * plane_group<NR, CMP>() * k;
    const auto scale = [&](const int32_t* cb, int64_t blk) {
        scale_block<P, NR, CMP>(cb, dm + blk * 32, dx + blk * m_stride, sx + blk * m_stride,
                                acc);
    };
    const auto step = [&](auto set, int64_t blk) {
        constexpr int S = decltype(set)::value;
        if (blk + 1 < nb)
            issue_block<NA, 1 - S>(xa + (blk + 1) * QK, k, a1, bq + (blk + 1) * B_BYTES);
        if (blk > 0) scale(c[1 - S], blk - 1);
        unload_block<NA, S>(c[S]);
    };
    issue_block<NA, 0>(xa, k, a1, bq);
    for (int64_t b = 0; b < nb; b += 2) {
        step(std::integral_constant<int, 0>{}, b);
        if (b + 1 < nb) step(std::integral_constant<int, 1>{}, b + 1);
    }
    scale(c[(nb - 1) & 1], nb - 1);
#pragma GCC unroll 16
    for (int t = 0; t < NR; ++t) _mm512_store_ps(out + 16 * t, acc[t]);
}

template <int P, int NR = 16>
void amx_pass_rows(int64_t nr, bool compact, const int8_t* xa, int64_t k, const float* dx,
                   const float* sx, int64_t m_stride, const uint8_t* bq, const float* dm,
                   int64_t nb, float* out) {
    if constexpr (NR > 1) {
        if (nr < NR)
            return amx_pass_rows<P, NR - 1>(nr, compact, xa, k, dx, sx, m_stride, bq, dm, nb,
                                            out);
    }
    if constexpr (P == 2) {
        if (compact) return amx_pass<P, NR, true>(xa, k, dx, sx, m_stride, bq, dm, nb, out);
    }
    amx_pass<P, NR, false>(xa, k, dx, sx, m_stride, bq, dm, nb, out);
}

// One tile's weight blocks as B tiles (nibbles masked / shifted) and float scales.
template <typename S>
void unpack_tile(const uint8_t* w, int64_t nb, uint8_t* bq, float* dm) {
    constexpr int64_t SB = 2 * ROWS * sizeof(S);
    constexpr int64_t BLOCK = SB + QS_BYTES;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        for (int h = 0; h < 2; ++h) {
            __m512 v;
            if constexpr (sizeof(S) == 2) {
                v = _mm512_cvtph_ps(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * h)));
            } else {
                v = _mm512_loadu_ps(blk + 64 * h);
            }
            _mm512_store_ps(dm + b * 32 + 16 * h, v);
        }
        for (int j = 0; j < 4; ++j) {
            const __m512i raw = _mm512_loadu_si512(blk + SB + 64 * j);
            _mm512_store_si512(bq + b * B_BYTES + 64 * j, _mm512_and_si512(raw, low4));
            _mm512_store_si512(bq + b * B_BYTES + 64 * (4 + j),
                               _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
        }
    }
}

// Rows of x per pass (one set of accumulators in registers).
constexpr int64_t PASS_ROWS = 16;

template <int P>
void amx_quantize_and_multiply(int dtype, const void* x, int64_t x_stride, const uint8_t* w,
                               int scale_bytes, void* y, int64_t y_stride, int64_t m_rows,
                               int64_t n, int64_t k, int threads) {
    const int64_t nb = k / QK;
    // A rows: one plane, x's rows in order; two planes, per group of rows of x (8, or all
    // rows split evenly over one or two A tiles where there are at most 16: `compact`,
    // plane_group) their plane-1 rows then their plane-2 rows. Padded to whole A tiles; the
    // rows past m_rows only reach product rows never read.
    const bool compact = P == 2 && m_rows <= 16;
    const int64_t group = !compact ? 8 : m_rows <= 8 ? m_rows : (m_rows + 1) / 2;
    const int64_t a_rows =
        P == 1 ? (m_rows + 15) / 16 * 16 : (m_rows + group - 1) / group * 2 * group;
    const int64_t m_stride = (m_rows + 15) / 16 * 16;
    const size_t elt = dtype == 1 ? 2 : 4;
    // The A rows, then dx and sx [nb][m_stride].
    thread_local std::vector<uint8_t> buffer;
    const int64_t scale_off = (a_rows * k + 63) / 64 * 64;
    buffer.resize(static_cast<size_t>(scale_off + 2 * m_stride * nb * 4));
    uint8_t* base = buffer.data();
    int8_t* xq = reinterpret_cast<int8_t*>(base);
    float* dx = reinterpret_cast<float*>(base + scale_off);
    float* sx = dx + m_stride * nb;
    const int qthreads = m_rows >= 16 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
    for (int64_t r = 0; r < m_rows; ++r) {
        const void* xr = static_cast<const char*>(x) + r * x_stride * elt;
        const int64_t a = P == 1 ? r : (r / group) * 2 * group + r % group;
        for (int64_t b = 0; b < nb; ++b)
            quantize_block<P>(xr, dtype, b, xq + a * k + b * QK, group * k,
                              dx + b * m_stride + r, sx + b * m_stride + r);
    }
    const int64_t tiles = (n + ROWS - 1) / ROWS;
    const int64_t sbytes = scale_bytes;
    const int64_t tile_bytes = nb * (2 * ROWS * sbytes + QS_BYTES);
    const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
#pragma omp parallel num_threads(team) if (team > 1)
    {
        thread_local std::vector<uint8_t> unpacked;
        unpacked.resize(static_cast<size_t>(nb * (B_BYTES + 32 * 4) + 64));
        uint8_t* bq = reinterpret_cast<uint8_t*>(
            (reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t{63});
        float* dm = reinterpret_cast<float*>(bq + nb * B_BYTES);
        alignas(64) float out[PASS_ROWS * 16];
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            if (scale_bytes == 2) {
                unpack_tile<uint16_t>(w + tile * tile_bytes, nb, bq, dm);
            } else {
                unpack_tile<float>(w + tile * tile_bytes, nb, bq, dm);
            }
            const int64_t rows = std::min<int64_t>(ROWS, n - tile * ROWS);
            for (int64_t m0 = 0; m0 < m_rows; m0 += PASS_ROWS) {
                const int64_t nr = std::min<int64_t>(PASS_ROWS, m_rows - m0);
                const int na = P == 1 || nr <= 8 ? 1 : 2;
                const int pass_rows = static_cast<int>(P == 1 ? nr : compact ? 2 * group : 16);
                if (na * 32 + pass_rows != configured) {
                    configure_tiles(na, pass_rows);
                    configured = na * 32 + pass_rows;
                }
                amx_pass_rows<P>(nr, compact, xq + (P == 1 ? m0 : 2 * m0) * k, k, dx + m0,
                                 sx + m0, m_stride, bq, dm, nb, out);
                for (int64_t t = 0; t < nr; ++t)
                    store_outputs(out + t * ROWS, y, (m0 + t) * y_stride + tile * ROWS, rows,
                                  dtype);
            }
        }
        if (configured) _tile_release();
    }
}

// ---- AMX-BF16: the weights decompressed to bf16 tiles, x in bf16, fp32 sums -----------------
//
// The int8 kernel above pays float work for every block of 32 inputs (each block has its own
// scales, so its integer sums cannot stay in the tile); TDPBF16PS keeps the fp32 sums in the
// tile over a chunk of K (then in an fp32 buffer), and the scales go into the weights
// instead: each weight block becomes w = d * q + m in fp32 (one fused multiply-add), rounded
// to bf16 (as the dense bf16 copy of the layer is made), once per call and tile of outputs,
// then meets every row of x. The result is the dense bf16 product (x rounded to bf16, fp32
// sums in another order) without the dense copy in memory.
// Tiles: see amx_bf16_gemm.h.

using pagemill_amx::BF_TILE;
using pagemill_amx::bf16_pass;
using pagemill_amx::bf16_x_tiles;
using pagemill_amx::configure_bf16_tiles;

// One weight block of a tile (16 outputs) as a bf16 B tile: row kk holds, per output r, the
// inputs 2kk and 2kk + 1 (one 32-bit lane per output). A 64-byte line j of nibbles has one
// 32-bit lane per output r too, holding inputs 4j + t (low nibble of byte t) and
// 16 + 4j + t (high): shifts pick one input for all 16 outputs at once, with the outputs'
// scales in the same lanes, and each pair of inputs is interleaved into a B row. The nibble
// becomes a float by a lane permute of 0.0 .. 15.0 (vpermps reads the index's low 4 bits:
// no mask, no conversion).
template <typename S>
inline void unpack_block_bf16(const uint8_t* blk, uint8_t* out, __m512i pairs, __m512 values) {
    constexpr int64_t SB = 2 * ROWS * sizeof(S);
    __m512 d, m;
    load_block_scales<S>(blk, d, m);
    for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(blk + SB + 64 * j);
        for (int h = 0; h < 2; ++h) {      // low nibbles: inputs 4j + t; high: 16 + 4j + t
            for (int p = 0; p < 2; ++p) {  // inputs t = 2p, 2p + 1: B row 8h + 2j + p
                __m512 f[2];
                for (int u = 0; u < 2; ++u) {
                    const int shift = 8 * (2 * p + u) + 4 * h;
                    const __m512i q = shift ? _mm512_srli_epi32(raw, shift) : raw;
                    f[u] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, values), d, m);
                }
                const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
                _mm512_store_si512(out + 64 * (8 * h + 2 * j + p),
                                   _mm512_permutexvar_epi16(pairs, both));
            }
        }
    }
}

// The B tiles of a thread's output pairs, produced a block at a time in their order (pair,
// then tile, then block) into a ring of `slots` pairs, so that the passes over pairs already
// unpacked can unpack the next ones between their tile instructions (the vector units and
// the matrix unit run side by side).
struct BFeed {
    const uint8_t* w;
    int64_t tile_bytes, tiles, nb, pair_bytes, slots, p0;
    // Tile h (0, 1) of pair p is tile pair_step * p + h * half_step: (2p, 2p + 1), or, for
    // silu_and_mul's gate | up layer, (p, p + tiles / 2), a gate tile and its up tile.
    int64_t pair_step, half_step;
    uint8_t* bt;
    int scale_bytes;
    __m512i pairs;
    __m512 values;
    int64_t next = 0;   // tile-blocks done, from the thread's first pair
    int64_t limit = 0;  // no further: the ring's slots past it still hold pairs in use

    uint8_t* pair_tiles(int64_t pair) const { return bt + (pair - p0) % slots * pair_bytes; }

    inline void step() {
        const int64_t per = 2 * nb;
        const int64_t pr = next / per;
        const int64_t h = next % per / nb;
        const int64_t b = next % nb;
        uint8_t* out = pair_tiles(p0 + pr) + (2 * b + h) * BF_TILE;
        const int64_t tile = pair_step * (p0 + pr) + h * half_step;
        if (tile >= tiles) {
            std::memset(out, 0, BF_TILE);
        } else if (scale_bytes == 2) {
            unpack_block_bf16<uint16_t>(w + tile * tile_bytes + b * (4 * ROWS + QS_BYTES), out,
                                        pairs, values);
        } else {
            unpack_block_bf16<float>(w + tile * tile_bytes + b * (8 * ROWS + QS_BYTES), out,
                                     pairs, values);
        }
        ++next;
    }
    // Called once per block multiplied: num / den blocks unpacked per call on average,
    // within the limit.
    int64_t num = 1, den = 1, credit = 0;
    inline void tick() {
        if (next >= limit) return;
        credit += num;
        for (; credit >= den && next < limit; credit -= den) step();
    }
    // Everything up to and including `pair`.
    void through(int64_t pair) {
        const int64_t need = (pair - p0 + 1) * 2 * nb;
        while (next < need) step();
    }
};

// Blocking. Each thread owns a range of output tile pairs (two threads get halves of the
// pairs, so that each weight block is unpacked once per call) and unpacks them a block at a
// time between the tile instructions of the passes over pairs already unpacked (BFeed): the
// vector units' unpacking and the matrix unit's products run side by side. Rows of x pass
// 32 at a time (2 A tiles; a final 1..16 rows use one A tile and half the products), over K
// in chunks of at most BF_KC_BLOCKS blocks (a chunk's A tiles, 32 KB, stay in L1 while
// pairs meet them). Where x in bf16 fits BF_X_L2_BYTES, a pair at a time meets every row
// (x from L2, the pair's B tiles from L1 or L2) while the next pair is unpacked. Above it the
// pairs go in panels of BF_PANEL_BYTES of B tiles kept in L2 while every row passes (each
// chunk of rows read once per panel, not once per pair), the next panel unpacked over the
// passes of the current one into the other half of a ring of two panels.
constexpr int64_t BF_PANEL_BYTES = 512 * 1024;
constexpr int64_t BF_KC_BLOCKS = 16;
// Up to this much of x in bf16 (it stays in L2), pairs go one at a time through all rows.
constexpr int64_t BF_X_L2_BYTES = 1 << 20;
constexpr int64_t BF_OWN_X_ROWS = 128;

// v rounded to bf16 (to nearest even, as store_outputs rounds) and back to fp32.
inline __m512 round_to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
        _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, v);
}

// e^v, within about an ulp of fp32: v = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts so that
// r is exact), e^r by its Taylor series to r^7 (the next term is below 1e-8 of the result),
// times 2^n by vscalefps (which gives inf and 0 past fp32's range, and keeps NaN).
inline __m512 exp_ps(__m512 v) {
    const __m512 x = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(100.0f)),
                                   _mm512_set1_ps(-110.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(p, n);
    // NaN in, NaN out (the clamp above would have made it a number).
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

// y[i .. i + 16) = silu(g) * u for one row of a gate tile and its up tile: g and u first
// rounded to y's dtype (what a separate gate | up product would have stored), then
// g / (1 + e^-g) * u in fp32, rounded once. The division is a reciprocal estimate refined
// by one Newton step (within about an ulp; a vector division costs several times the rest
// of the epilogue), except where 1 + e^-g is so large that the reciprocal would leave the
// normal range (a real division then: -0 for e^-g = inf, as torch gives).
inline void store_silu_mul(const float* g, const float* u, void* y, int64_t i, int dtype) {
    __m512 gv = _mm512_loadu_ps(g);
    __m512 uv = _mm512_loadu_ps(u);
    if (dtype == 1) {
        gv = round_to_bf16(gv);
        uv = round_to_bf16(uv);
    }
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 s;
    if (_mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p120f), _CMP_NLT_UQ) != 0) {
        s = _mm512_div_ps(gv, d);
    } else {
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
        s = _mm512_mul_ps(gv, r);
    }
    alignas(64) float out[ROWS];
    _mm512_store_ps(out, _mm512_mul_ps(s, uv));
    store_outputs(out, y, i, ROWS, dtype);
}

// silu: w is a gate | up layer (N = 2 I, I a multiple of 16) and y [m_rows, I] gets
// silu(x Wg^T) * (x Wu^T): each pair of tiles is a gate tile and its up tile (BFeed), so
// both products of an output meet in the pair's fp32 tiles.
void amx_bf16_multiply(int dtype, const void* x, int64_t x_stride, const uint8_t* w,
                       int scale_bytes, void* y, int64_t y_stride, int64_t m_rows, int64_t n,
                       int64_t k, int threads, bool silu = false) {
    const int64_t nb = k / QK;
    const int64_t m_pad = (m_rows + 15) / 16 * 16;
    // x in bf16 as A tiles (bf16_x_tiles). Up to BF_OWN_X_ROWS rows each thread converts all
    // of x for itself, inside the one parallel region: a second region's fork and join
    // costs more than the copy there (and far more where the threads share the cores with
    // other processes). More rows: one copy, split over the threads.
    const bool own_x = m_rows <= BF_OWN_X_ROWS;
    const size_t x_elems = static_cast<size_t>((m_rows + 31) / 32 * 32 * k);
    thread_local std::vector<uint16_t> xbuf;
    uint16_t* shared_xb = nullptr;
    if (!own_x) {
        xbuf.resize(x_elems);
        shared_xb = xbuf.data();
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t r = 0; r < m_pad; ++r)
            bf16_x_tiles(dtype, x, x_stride, m_rows, nb, r, shared_xb);
    }
    const int64_t tiles = (n + ROWS - 1) / ROWS;
    const int64_t pairs = silu ? tiles / 2 : (tiles + 1) / 2;
    const int64_t pair_step = silu ? 1 : 2;
    const int64_t half_step = silu ? tiles / 2 : 1;
    const int64_t tile_bytes = nb * (2 * ROWS * static_cast<int64_t>(scale_bytes) + QS_BYTES);
    const int64_t pair_bytes = nb * 2 * BF_TILE;
    const int64_t chunks = (nb + BF_KC_BLOCKS - 1) / BF_KC_BLOCKS;
    const int64_t kc = (nb + chunks - 1) / chunks;
    const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, pairs)));
#pragma omp parallel num_threads(team) if (team > 1)
    {
#pragma omp for schedule(static)
        for (int part = 0; part < team; ++part) {
            const int64_t p0 = pairs * part / team;
            const int64_t p1 = pairs * (part + 1) / team;
            uint16_t* xb = shared_xb;
            if (own_x) {
                thread_local std::vector<uint16_t> own;
                own.resize(x_elems);
                xb = own.data();
                for (int64_t r = 0; r < m_pad; ++r)
                    bf16_x_tiles(dtype, x, x_stride, m_rows, nb, r, xb);
            }
            // Where x stays in L2 (or is one block of rows, reused by nothing), one pair at a
            // time meets every row while the next one is unpacked beside it.
            const int64_t panel =
                m_rows * k * 2 <= BF_X_L2_BYTES || m_rows <= 32
                    ? 1
                    : std::max<int64_t>(1,
                                        std::min<int64_t>(p1 - p0, BF_PANEL_BYTES / pair_bytes));
            // B tiles of two panels (the one in use, the next one being unpacked), pair by
            // pair: [slots][nb][2][16 x 64 bytes]; then the products per pair between K
            // chunks, [panel][4][16 x 16] fp32.
            const int64_t slots = std::min(p1 - p0, 2 * panel);
            thread_local std::vector<uint8_t> unpacked;
            const int64_t cbytes = (chunks > 1 ? panel : 1) * 4 * 1024;
            unpacked.resize(static_cast<size_t>(slots * pair_bytes + cbytes + 64));
            uint8_t* bt = reinterpret_cast<uint8_t*>(
                (reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t{63});
            float* cbuf = reinterpret_cast<float*>(bt + slots * pair_bytes);
            alignas(64) int16_t pair_idx[32];
            for (int l = 0; l < 32; ++l) pair_idx[l] = static_cast<int16_t>(l / 2 + 16 * (l % 2));
            BFeed feed{w,         tile_bytes, tiles,    nb,        pair_bytes,
                       slots,     p0,         pair_step, half_step, bt,
                       scale_bytes, _mm512_load_si512(pair_idx),
                       _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
            const int64_t m_blocks = (m_rows + 31) / 32;
            configure_bf16_tiles();
            for (int64_t q0 = p0; q0 < p1; q0 += panel) {
                const int64_t q1 = std::min(p1, q0 + panel);
                feed.limit = (std::min(p1, q1 + panel) - p0) * 2 * nb;
                for (int64_t m0 = 0; m0 < m_rows; m0 += 32) {
                    // One pair a panel: the next pair unpacked evenly over all its passes.
                    // Else the first block of rows meets the panel's pairs as they are
                    // unpacked (a pass over one chunk of K unpacks about the next pair), and the
                    // later blocks spread the next panel's unpacking over their passes.
                    if (panel == 1) {
                        feed.num = 2;
                        feed.den = m_blocks;
                    } else if (m0 == 0) {
                        feed.num = (2 * nb + kc - 1) / kc;
                        feed.den = 1;
                    } else {
                        feed.num = 2;
                        feed.den = m_blocks - 1;
                    }
                    feed.credit = 0;
                    const bool one = m_rows - m0 <= 16;
                    const uint16_t* xa = xb + m0 * k;
                    for (int64_t b0 = 0; b0 < nb; b0 += kc) {
                        const int64_t b1 = std::min(nb, b0 + kc);
                        for (int64_t pair = q0; pair < q1; ++pair) {
                            feed.through(pair);
                            const uint8_t* bp = feed.pair_tiles(pair);
                            float* c = cbuf + (chunks > 1 ? (pair - q0) * 1024 : 0);
                            if (one) {
                                bf16_pass<true>(xa, bp, b0, b1, b0 == 0, c, feed);
                            } else {
                                bf16_pass<false>(xa, bp, b0, b1, b0 == 0, c, feed);
                            }
                            if (b1 < nb) continue;
                            for (int mh = 0; mh < (one ? 1 : 2); ++mh) {
                                const int64_t r0 = m0 + 16 * mh;
                                const int64_t tm = std::min<int64_t>(16, m_rows - r0);
                                if (silu) {
                                    const float* cg = c + 2 * mh * 256;
                                    for (int64_t t = 0; t < tm; ++t)
                                        store_silu_mul(cg + t * ROWS, cg + 256 + t * ROWS, y,
                                                       (r0 + t) * y_stride + pair * ROWS,
                                                       dtype);
                                    continue;
                                }
                                for (int h = 0; h < 2; ++h) {
                                    const int64_t tile = 2 * pair + h;
                                    if (tile >= tiles) continue;
                                    const int64_t rows = std::min<int64_t>(ROWS, n - tile * ROWS);
                                    const float* ct = c + (2 * mh + h) * 256;
                                    for (int64_t t = 0; t < tm; ++t)
                                        store_outputs(ct + t * ROWS, y,
                                                      (r0 + t) * y_stride + tile * ROWS, rows,
                                                      dtype);
                                }
                            }
                        }
                    }
                }
            }
            _tile_release();
        }
    }
}
#endif  // AMX

// From how many rows of x the AMX-INT8 kernel beats the AVX-512 GEMV, by planes, on the
// machine it was written for (Sapphire Rapids): two planes double the GEMV's integer work,
// and the tiles take both planes in one A tile.
constexpr int AMX_GEMV_ROWS_1 = 12;
constexpr int AMX_GEMV_ROWS_2 = 6;

// -1: AMX_GEMV_ROWS_<planes>; 0: never; n > 0: from n rows.
std::atomic<int>& gemv_amx_setting() {
    static std::atomic<int> rows{[] {
        const char* env = std::getenv("PAGEMILL_CPU_GEMV_AMX");
        if (env == nullptr || *env == '\0') return -1;
        const int v = std::atoi(env);
        return v == 1 || std::strcmp(env, "auto") == 0 ? -1 : std::max(0, v);
    }()};
    return rows;
}

// The row count from which pagemill_gemv_q4 with `planes` runs on the tiles (0: never).
int gemv_amx_rows(int planes) {
    const int v = gemv_amx_setting().load(std::memory_order_relaxed);
    return v >= 0 ? v : planes == 2 ? AMX_GEMV_ROWS_2 : AMX_GEMV_ROWS_1;
}

}  // namespace

extern "C" {

// Which arithmetic this build runs (PAGEMILL_GEMV_ISA's values).
int pagemill_gemv_q4_isa() { return PAGEMILL_GEMV_ISA; }

// dtype: 0 fp32, 1 bf16 (x and y). scale_bytes: 2 (fp16 blocks) or 4 (fp32 blocks).
// planes: 1 (x rounded to int8 per block) or 2 (plus its remainder in a second int8 plane).
// x [m_rows, k] with row stride x_stride (elements), y [m_rows, n] with row stride y_stride.
// Returns 0, or a nonzero status for arguments it refuses.
int pagemill_gemv_q4(int dtype, const void* x, int64_t x_stride, const void* w, int scale_bytes,
                     void* y, int64_t y_stride, int64_t m_rows, int64_t n, int64_t k,
                     int threads, int planes) {
    if ((dtype != 0 && dtype != 1) || (scale_bytes != 2 && scale_bytes != 4)) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (planes != 1 && planes != 2) return 3;
    if (m_rows == 0 || n == 0) return 0;
    threads = std::max(1, threads);
    const uint8_t* wb = static_cast<const uint8_t*>(w);
#ifdef PAGEMILL_HAVE_AMX
    const int from = gemv_amx_rows(planes);
    if (from > 0 && m_rows >= from && amx_usable()) {
        if (planes == 2) {
            amx_quantize_and_multiply<2>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows,
                                         n, k, threads);
        } else {
            amx_quantize_and_multiply<1>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows,
                                         n, k, threads);
        }
        return 0;
    }
#endif
    if (planes == 2) {
        quantize_and_multiply<2>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows, n, k,
                                 threads);
    } else {
        quantize_and_multiply<1>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows, n, k,
                                 threads);
    }
    return 0;
}

// Where pagemill_gemv_q4 runs on the AMX-INT8 tiles (the same result to the bit): rows -1
// from a row count set per planes for this machine, 0 never, n > 0 from n rows of x; -2
// only asks. Returns the previous setting. It starts from PAGEMILL_CPU_GEMV_AMX: "0" never,
// unset, "1" or "auto" -1, another number n.
int pagemill_gemv_q4_set_amx_rows(int rows) {
    if (rows < -1) return gemv_amx_setting().load();
    return gemv_amx_setting().exchange(rows);
}

// The row count from which pagemill_gemv_q4 with `planes` runs on the AMX tiles here (0:
// never, and where this build or machine has no AMX).
int pagemill_gemv_q4_amx_rows(int planes) {
#ifdef PAGEMILL_HAVE_AMX
    return amx_usable() ? gemv_amx_rows(planes) : 0;
#else
    (void)planes;
    return 0;
#endif
}

// Whether pagemill_gemm_q4_amx runs here: AMX-INT8 in this build and on this machine, and
// the kernel's permission for the tiles' state.
int pagemill_gemm_q4_amx_available() {
#ifdef PAGEMILL_HAVE_AMX
    return amx_usable() ? 1 : 0;
#else
    return 0;
#endif
}

// pagemill_gemv_q4's product on the AMX tiles, for batches (each 16 rows of x is one tile
// pass; fewer rows pay for 16). planes 1 or 2: AMX-INT8, the same arguments and results to
// the bit; planes 0: AMX-BF16 on weights decompressed to bf16 (the dense bf16 product, no
// int8 rounding). Status 4 where AMX is not available (pagemill_gemm_q4_amx_available).
int pagemill_gemm_q4_amx(int dtype, const void* x, int64_t x_stride, const void* w,
                         int scale_bytes, void* y, int64_t y_stride, int64_t m_rows, int64_t n,
                         int64_t k, int threads, int planes) {
    if ((dtype != 0 && dtype != 1) || (scale_bytes != 2 && scale_bytes != 4)) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (planes < 0 || planes > 2) return 3;
#ifdef PAGEMILL_HAVE_AMX
    if (!amx_usable()) return 4;
    if (m_rows == 0 || n == 0) return 0;
    threads = std::max(1, threads);
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    if (planes == 0) {
        amx_bf16_multiply(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows, n, k,
                          threads);
    } else if (planes == 2) {
        amx_quantize_and_multiply<2>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows, n,
                                     k, threads);
    } else {
        amx_quantize_and_multiply<1>(dtype, x, x_stride, wb, scale_bytes, y, y_stride, m_rows, n,
                                     k, threads);
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)y, (void)y_stride, (void)threads;
    return 4;
#endif
}

// silu(x Wg^T) * (x Wu^T) -> y [m_rows, n / 2] (row stride y_stride) for a gate | up layer
// w of n = 2 I outputs (gate rows first), on the AMX-BF16 tiles as pagemill_gemm_q4_amx with
// planes 0; g and u rounded to y's dtype before the activation, the result rounded once.
// Status 5 where I is not a multiple of 16 (a tile would hold gate and up rows), 4 where AMX
// is not available.
int pagemill_gemm_q4_amx_silu_mul(int dtype, const void* x, int64_t x_stride, const void* w,
                                  int scale_bytes, void* y, int64_t y_stride, int64_t m_rows,
                                  int64_t n, int64_t k, int threads) {
    if ((dtype != 0 && dtype != 1) || (scale_bytes != 2 && scale_bytes != 4)) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (n % (2 * ROWS) != 0) return 5;
#ifdef PAGEMILL_HAVE_AMX
    if (!amx_usable()) return 4;
    if (m_rows == 0 || n == 0) return 0;
    amx_bf16_multiply(dtype, x, x_stride, static_cast<const uint8_t*>(w), scale_bytes, y,
                      y_stride, m_rows, n, k, std::max(1, threads), true);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)y, (void)y_stride, (void)threads;
    return 4;
#endif
}

}  // extern "C"
