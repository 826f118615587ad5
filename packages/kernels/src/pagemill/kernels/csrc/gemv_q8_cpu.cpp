// y[M, N] = x[M, K] · W[N, K]ᵀ over GGUF Q8_0 weight blocks (32 int8 values and one fp16
// scale each), with the activations quantized to int8 per block of 32 and the dot products
// done in integers, as llama.cpp runs Q8_0 against Q8_0. Few rows of x (decode steps, an
// LM head over the sampled rows) are bound by reading W: each weight block is read once, in
// one stream, with its scales next to it.
//
// Weights come in tiles of 16 output rows; per tile and block of 32 inputs:
//     uint16_t d[16] (fp16); int8_t qs[512];      w[r][j] = d[r] * q[r][j]
// with byte (j, r, t), j < 8, r < 16, t < 4, holding q[r][4j + t]: one 4-byte lane holds 4
// consecutive inputs of one output row, so a 4-wide dot of such a vector against 4 inputs
// of x broadcast to every lane leaves each row's partial sum in its own lane (no horizontal
// sums) and the 16 rows' scales apply as one vector.
//
// Signed weights times signed activations, three ways (integer sums are exact in each, so
// builds differ only in float summation order):
// - VNNI (`vpdpbusd` multiplies u8 by s8): the weight bytes are flipped to w + 128 (u8),
//   and 128 times the block's integer sum of the activations is taken off again;
// - AVX2 (`vpmaddubsw`, u8 × s8 into saturating int16): the sign trick, |w| times x with
//   w's sign, |w| * |x| <= 128 * 127, so a pair sums to at most 32512 and never saturates;
//   with two planes instead `vpmaddwd` on int16, the planes as one 254 * q1 + q2 against
//   the widened weights (tile_rows_x16: one product per input for both planes; the block
//   sum 254 * s1 + s2 takes one float conversion, so this build's float steps differ too);
// - plain C++.
// PAGEMILL_GEMV_ISA forces one (0 plain, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI) for tests.
// On the AVX-512 build a machine with AMX-INT8 runs calls of AMX_MIN_ROWS rows and more on
// the matrix units instead (see "AMX" below): the same integers and float steps, the same bits.
// PAGEMILL_CPU_GEMV_AMX: 0 never, a number n from n rows (as for gemv_q4).
//
// Activation block: q1 = round(x / dx) in -127..127 with dx = max|x| / 127; with two
// planes also the remainder rounded in steps of dx / 254 (q2), so x ≈ dx * (q1 + q2 / 254).
//
// Built at run time by pagemill.kernels.gemv_q8_cpu (host compiler, -O3 -march=native
// -fopenmp, no torch headers) and called through ctypes. Output rows are split over
// OpenMP threads by tiles; up to four rows of x share each weight block while it is in
// registers. Each thread asks for its weights a few blocks ahead of use (PREFETCH_BLOCKS).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && (defined(__AMX_INT8__) || defined(__AMX_BF16__)) && defined(__linux__)
#include "amx_tiles.h"
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_bf16_gemm.h"
#endif

#include <cstdlib>
#endif

#ifndef PAGEMILL_GEMV_ISA
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define PAGEMILL_GEMV_ISA 3
#elif defined(__AVXVNNI__)
#define PAGEMILL_GEMV_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEMILL_GEMV_ISA 1
#else
#define PAGEMILL_GEMV_ISA 0
#endif
#endif

namespace {

constexpr int QK = 32;
constexpr int MAX_TILE = 4;
constexpr int ROWS = 16;                       // output rows interleaved in one tile
constexpr int64_t QS_BYTES = ROWS * QK;        // int8 values of one block of a tile
constexpr int64_t SB = ROWS * 2;               // fp16 scales of one block of a tile
constexpr int64_t BLOCK = SB + QS_BYTES;

// Blocks ahead of the one being multiplied that are asked from memory by hand: the hardware's
// stream prefetch alone leaves one core short of the rate memory can deliver.
constexpr int64_t PREFETCH_BLOCKS = 4;

inline void prefetch_block(const uint8_t* blk) {
#if PAGEMILL_GEMV_ISA >= 1
    for (int64_t l = 0; l < BLOCK; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BLOCKS * BLOCK + l),
                     _MM_HINT_T0);
#else
    (void)blk;
#endif
}

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

// One tile's 16 (or `rows` < 16) outputs of one row of x to y[i0..], in fp32 or rounded to
// bf16 as float_to_bf16 does.
inline void store_outputs(const float* v, void* y, int64_t i0, int64_t rows, int dtype) {
#if PAGEMILL_GEMV_ISA == 3
    const __mmask16 keep = rows >= ROWS ? __mmask16(0xffff) : __mmask16((1u << rows) - 1u);
    const __m512 f = _mm512_loadu_ps(v);
    if (dtype == 1) {
        const __m512i bits = _mm512_castps_si512(f);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i even =
            _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        const __m512i top = _mm512_mask_or_epi32(_mm512_srli_epi32(even, 16), nan,
                                                 _mm512_srli_epi32(bits, 16),
                                                 _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i0, keep,
                                 _mm512_cvtepi32_epi16(top));
    } else {
        _mm512_mask_storeu_ps(static_cast<float*>(y) + i0, keep, f);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
        if (dtype == 1) {
            static_cast<uint16_t*>(y)[i0 + r] = float_to_bf16(v[r]);
        } else {
            static_cast<float*>(y)[i0 + r] = v[r];
        }
    }
#endif
}

// One row of x quantized: xq [K * P] int8 (per block: P planes of 32), dx [K / 32] and the
// integer sum of each block's plane, isum [K / 32 * P] (the VNNI offset's correction).
template <int P>
void quantize_row(const void* x, int dtype, int64_t k, int8_t* xq, float* dx, int32_t* isum) {
    float buf[QK];
    for (int64_t b = 0; b < k / QK; ++b) {
        for (int j = 0; j < QK; ++j) {
            const int64_t i = b * QK + j;
            buf[j] = dtype == 1 ? bf16_to_float(static_cast<const uint16_t*>(x)[i])
                                : static_cast<const float*>(x)[i];
        }
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(buf[j]));
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t* xb = xq + b * P * QK;
        int32_t s1 = 0, s2 = 0;
        for (int j = 0; j < QK; ++j) {
            const float q1 = std::nearbyint(buf[j] * inv);
            xb[j] = static_cast<int8_t>(q1);
            s1 += xb[j];
            if constexpr (P == 2) {
                // The remainder, |r| <= d / 2, in steps of d / 254.
                const float rest = buf[j] - q1 * d;
                const float q2 = std::nearbyint(rest * (inv * 254.0f));
                xb[QK + j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q2)));
                s2 += xb[QK + j];
            }
        }
        dx[b] = d;
        isum[b * P] = s1;
        if constexpr (P == 2) isum[b * P + 1] = s2;
    }
}

// One tile of 16 output rows against rows x[0..T) of the tile of activations.
template <int T, int P>
void tile_rows(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t xq_stride,
               const float* dx, const int32_t* isum, int64_t s_stride, float* out /* [T][16] */) {
#if PAGEMILL_GEMV_ISA == 3
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        prefetch_block(blk);
        const __m512 d =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        __m512i wv[8];
        for (int j = 0; j < 8; ++j)
            wv[j] = _mm512_xor_si512(_mm512_loadu_si512(blk + SB + 64 * j), flip);
        for (int t = 0; t < T; ++t) {
            const int8_t* xb = xq + t * xq_stride + b * P * QK;
            const int32_t* is = isum + (t * s_stride + b) * P;
            __m512 p;
            for (int plane = 0; plane < P; ++plane) {
                __m512i s0 = _mm512_set1_epi32(-128 * is[plane]), s1 = _mm512_setzero_si512();
                for (int i = 0; i < 8; i += 2) {
                    int32_t x0, x1;
                    std::memcpy(&x0, xb + plane * QK + 4 * i, 4);
                    std::memcpy(&x1, xb + plane * QK + 4 * i + 4, 4);
                    s0 = _mm512_dpbusd_epi32(s0, wv[i], _mm512_set1_epi32(x0));
                    s1 = _mm512_dpbusd_epi32(s1, wv[i + 1], _mm512_set1_epi32(x1));
                }
                const __m512 ps = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                p = plane == 0 ? ps : _mm512_fmadd_ps(ps, _mm512_set1_ps(1.0f / 254.0f), p);
            }
            acc[t] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(dx[t * s_stride + b])),
                                     acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * ROWS, acc[t]);
#elif PAGEMILL_GEMV_ISA >= 1
    // Two halves of 8 rows in 256-bit vectors.
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
#if PAGEMILL_GEMV_ISA == 2
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#else
    const __m256i one = _mm256_set1_epi16(1);
#endif
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        prefetch_block(blk);
        for (int h = 0; h < 2; ++h) {
            const __m256 d =
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
            __m256i wv[8];
            for (int j = 0; j < 8; ++j) {
                const __m256i raw =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SB + 64 * j + 32 * h));
#if PAGEMILL_GEMV_ISA == 2
                wv[j] = _mm256_xor_si256(raw, flip);
#else
                wv[j] = raw;
#endif
            }
            for (int t = 0; t < T; ++t) {
                const int8_t* xb0 = xq + t * xq_stride + b * P * QK;
                __m256 p;
                for (int plane = 0; plane < P; ++plane) {
                    const int8_t* xb = xb0 + plane * QK;
#if PAGEMILL_GEMV_ISA == 2
                    const int32_t corr = -128 * isum[(t * s_stride + b) * P + plane];
                    __m256i s0 = _mm256_set1_epi32(corr), s1 = _mm256_setzero_si256();
#else
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#endif
                    for (int i = 0; i < 8; i += 2) {
                        int32_t x0, x1;
                        std::memcpy(&x0, xb + 4 * i, 4);
                        std::memcpy(&x1, xb + 4 * i + 4, 4);
                        const __m256i xv0 = _mm256_set1_epi32(x0), xv1 = _mm256_set1_epi32(x1);
#if PAGEMILL_GEMV_ISA == 2
                        s0 = _mm256_dpbusd_avx_epi32(s0, wv[i], xv0);
                        s1 = _mm256_dpbusd_avx_epi32(s1, wv[i + 1], xv1);
#else
                        const __m256i a0 = _mm256_sign_epi8(wv[i], wv[i]);
                        const __m256i a1 = _mm256_sign_epi8(wv[i + 1], wv[i + 1]);
                        s0 = _mm256_add_epi32(
                            s0, _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv0, wv[i])), one));
                        s1 = _mm256_add_epi32(
                            s1,
                            _mm256_madd_epi16(
                                _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv1, wv[i + 1])), one));
#endif
                    }
                    const __m256 ps = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
                    p = plane == 0 ? ps : _mm256_fmadd_ps(ps, _mm256_set1_ps(1.0f / 254.0f), p);
                }
                acc[t][h] = _mm256_fmadd_ps(
                    p, _mm256_mul_ps(d, _mm256_set1_ps(dx[t * s_stride + b])), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + t * ROWS + 8 * h, acc[t][h]);
#else
    float acc[T][ROWS];
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * BLOCK;
        uint16_t ds[ROWS];
        std::memcpy(ds, blk, sizeof ds);
        const int8_t* qs = reinterpret_cast<const int8_t*>(blk + SB);
        for (int t = 0; t < T; ++t) {
            for (int r = 0; r < ROWS; ++r) {
                float p = 0.0f;
                for (int plane = 0; plane < P; ++plane) {
                    const int8_t* xb = xq + t * xq_stride + b * P * QK + plane * QK;
                    int32_t dot = 0;
                    for (int j = 0; j < 8; ++j)
                        for (int u = 0; u < 4; ++u)
                            dot += static_cast<int32_t>(qs[(j * ROWS + r) * 4 + u]) * xb[4 * j + u];
                    p = plane == 0 ? static_cast<float>(dot)
                                   : std::fma(static_cast<float>(dot), 1.0f / 254.0f, p);
                }
                acc[t][r] += half_to_float(ds[r]) * dx[t * s_stride + b] * p;
            }
        }
    }
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < ROWS; ++r) out[t * ROWS + r] = acc[t][r];
#endif
}

#if PAGEMILL_GEMV_ISA == 1
// Two planes on AVX2, where `vpmaddubsw` needs the sign trick and saturates in int16, so each
// plane would cost a sign, a `vpmaddubsw`, a `vpmaddwd` and an add per 32 products: instead
// the planes meet in one int16 per input, x16 = 254 * q1 + q2 (|x16| <= 32385), and the
// weights, widened to int16 once per tile row block, meet both planes in one `vpmaddwd`
// (|w * x16| * 32 < 2^31: the block's sum is exact, 254 * s1 + s2 as the other builds' two
// sums). A vector holds 4 outputs x 4 inputs, so a block's two halves of 8 outputs end in
// `vphaddd` lane order (0, 1, 4, 5 | 2, 3, 6, 7): the scales are permuted to it and the sums
// put back in order once per tile.

// One block's half h (8 outputs, in `vphaddd` order) of T rows into acc.
template <int T>
inline void half_block_x16(const uint8_t* blk, int h, const int16_t* x16, int64_t x_stride,
                           int64_t b, const float* dx, int64_t s_stride, __m256* acc) {
    __m256i lo[T], hi[T];
    for (int t = 0; t < T; ++t) lo[t] = hi[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        const __m128i* raw = reinterpret_cast<const __m128i*>(blk + SB + 64 * j + 32 * h);
        const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(raw));
        const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(raw + 1));
        for (int t = 0; t < T; ++t) {
            int64_t xv;
            std::memcpy(&xv, x16 + t * x_stride + b * QK + 4 * j, 8);
            const __m256i xb = _mm256_set1_epi64x(xv);
            lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(wl, xb));
            hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(wh, xb));
        }
    }
    const __m256 d = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h))),
        _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(1.0f / 254.0f));
    for (int t = 0; t < T; ++t) {
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[t], hi[t]));
        acc[t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(ds, _mm256_set1_ps(dx[t * s_stride + b])),
                                 acc[t]);
    }
}

// Up to two rows of x take both halves of each block in turn, as the weights stream in; more
// rows run the tile's halves one after the other, so that a half's 2 x T integer sums, T
// float sums and the widened weights fit the 16 registers (the second half reads the tile
// from L1).
template <int T>
void tile_rows_x16(const uint8_t* w, int64_t nb, const int16_t* x16, int64_t x_stride,
                   const float* dx, int64_t s_stride, float* out /* [T][16] */) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    __m256 acc[2][T];
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < T; ++t) acc[h][t] = _mm256_setzero_ps();
    if constexpr (T <= 2) {
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + b * BLOCK;
            prefetch_block(blk);
            half_block_x16<T>(blk, 0, x16, x_stride, b, dx, s_stride, acc[0]);
            half_block_x16<T>(blk, 1, x16, x_stride, b, dx, s_stride, acc[1]);
        }
    } else {
        for (int h = 0; h < 2; ++h)
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = w + b * BLOCK;
                if (h == 0) prefetch_block(blk);
                half_block_x16<T>(blk, h, x16, x_stride, b, dx, s_stride, acc[h]);
            }
    }
    // Lane i of a sum holds output order[i], and the permutation is its own inverse.
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < T; ++t)
            _mm256_storeu_ps(out + t * ROWS + 8 * h, _mm256_permutevar8x32_ps(acc[h][t], order));
}

// x16 [m_rows, k] from the two int8 planes of each block (see tile_rows_x16).
void widen_planes(const int8_t* xq, int64_t m_rows, int64_t k, int16_t* x16) {
    for (int64_t r = 0; r < m_rows; ++r)
        for (int64_t b = 0; b < k / QK; ++b) {
            const int8_t* q = xq + (r * k + b * QK) * 2;
            for (int j = 0; j < QK; ++j)
                x16[r * k + b * QK + j] = static_cast<int16_t>(254 * q[j] + q[QK + j]);
        }
}
#endif

template <int P>
void gemv(const uint8_t* w, const int8_t* xq, const float* dx, const int32_t* isum, void* y,
          int dtype, int64_t m_rows, int64_t n, int64_t k, int64_t y_stride, int threads,
          const int16_t* x16 = nullptr) {
    const int64_t nb = k / QK;
    const int64_t tiles = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint8_t* wt = w + tile * nb * BLOCK;
        const int64_t rows = std::min<int64_t>(ROWS, n - tile * ROWS);
        for (int64_t m0 = 0; m0 < m_rows; m0 += MAX_TILE) {
            float out[MAX_TILE * ROWS];
            const int64_t tm = std::min<int64_t>(MAX_TILE, m_rows - m0);
            const int8_t* xt = xq + m0 * P * k;
            const float* dt = dx + m0 * nb;
            const int32_t* it = isum + m0 * nb * P;
#if PAGEMILL_GEMV_ISA == 1
            if (x16 != nullptr) {
                const int16_t* xw = x16 + m0 * k;
                switch (tm) {
                    case 4: tile_rows_x16<4>(wt, nb, xw, k, dt, nb, out); break;
                    case 3: tile_rows_x16<3>(wt, nb, xw, k, dt, nb, out); break;
                    case 2: tile_rows_x16<2>(wt, nb, xw, k, dt, nb, out); break;
                    default: tile_rows_x16<1>(wt, nb, xw, k, dt, nb, out); break;
                }
            } else
#endif
                switch (tm) {
                    case 4: tile_rows<4, P>(wt, nb, xt, P * k, dt, it, nb, out); break;
                    case 3: tile_rows<3, P>(wt, nb, xt, P * k, dt, it, nb, out); break;
                    case 2: tile_rows<2, P>(wt, nb, xt, P * k, dt, it, nb, out); break;
                    default: tile_rows<1, P>(wt, nb, xt, P * k, dt, it, nb, out); break;
                }
            for (int64_t t = 0; t < tm; ++t)
                store_outputs(out + t * ROWS, y, (m0 + t) * y_stride + tile * ROWS, rows, dtype);
        }
    }
}

// ---- AMX: the same product on the matrix units (TDPBSSD: s8 x s8 -> i32 tiles) --------------
//
// A tile's block is already what TDPBSSD wants as its B operand: K/4 = 8 rows of 16 outputs x
// 4 consecutive inputs, 64 bytes apart; so the packed weights load straight into a tile, with
// no unpacking or sign offset. x's quantized rows are the A tile (up to 16 rows x 32 int8, one
// per plane, read in place: a row's planes are P * K bytes apart). The integer dot products of
// 16 rows of x with the tile's 16 outputs (one product tile per plane) leave the matrix unit
// through memory, and each row then takes exactly tile_rows' float steps for that block
// (p = q1, p = q2 / 254 + p, acc += p * (d * dx)), block after block: the result is the
// AVX-512 GEMV's to the bit, at a fraction of its vector instructions per row of x.
//
// The tiles' state needs the kernel's permission once per process (arch_prctl) and a tile
// configuration per thread. PAGEMILL_CPU_GEMV_AMX=0 keeps every call on the vector kernel.

#if PAGEMILL_GEMV_ISA == 3 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define PAGEMILL_Q8_AMX 1

// From this many rows of x the matrix units beat the vector kernel.
constexpr int64_t AMX_MIN_ROWS = 5;

bool amx_usable() {
    static const bool ok = pagemill_amx::usable(pagemill_amx::TILE | pagemill_amx::INT8);
    return ok;
}

// The fewest rows sent to the tiles, from PAGEMILL_CPU_GEMV_AMX: unset, "1" or "auto"
// AMX_MIN_ROWS, "0" never (0), another number n from n rows (as gemv_q4 reads it).
int64_t amx_rows_setting() {
    const char* v = std::getenv("PAGEMILL_CPU_GEMV_AMX");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "1") == 0 || std::strcmp(v, "auto") == 0)
        return AMX_MIN_ROWS;
    return std::max(0, std::atoi(v));
}

using pagemill_amx::TileConfig;

// Two sets of tiles, so that the matrix unit multiplies one block while the vector units scale
// the block before: products of planes 0, 1 in tiles 0, 1 (set 0) or 4, 5 (set 1), rows x 16
// int32; the weight block in tile 6 or 7 (8 x 64 int8); the planes of x in tiles 2, 3 (rows x
// 32 int8), shared. rows: how many rows of x one pass takes.
void configure_tiles(int rows) {
    TileConfig cfg{};
    cfg.palette = 1;
    const uint8_t r = static_cast<uint8_t>(rows);
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = cfg.rows[5] = r;
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[4] = cfg.colsb[5] = 64;
    cfg.rows[2] = cfg.rows[3] = r;
    cfg.colsb[2] = cfg.colsb[3] = QK;
    cfg.rows[6] = cfg.rows[7] = QK / 4;
    cfg.colsb[6] = cfg.colsb[7] = 64;
    pagemill_amx::load_tile_config(cfg);
}

// One block's integer products (P planes of x at xb against the weight block at blk) into
// c [P][16][16], on product tiles C, C1 and weight tile B. A macro: GCC's tile intrinsics take
// tile numbers as literal register names.
#define PAGEMILL_Q8_AMX_PRODUCTS(C, C1, B, P, blk, xb, xq_stride, c) \
    do {                                                              \
        _tile_zero(C);                                                \
        _tile_loadd(B, (blk) + SB, 64);                               \
        _tile_loadd(2, (xb), (xq_stride));                            \
        _tile_dpbssd(C, 2, B);                                        \
        if constexpr ((P) == 2) {                                     \
            _tile_zero(C1);                                           \
            _tile_loadd(3, (xb) + QK, (xq_stride));                   \
            _tile_dpbssd(C1, 3, B);                                   \
        }                                                             \
        _tile_stored(C, (c), 64);                                     \
        if constexpr ((P) == 2) _tile_stored(C1, (c) + 256, 64);      \
    } while (0)

// How many blocks ahead the matrix unit runs of the vector units: a vector load of a line a
// tile store wrote waits until the store has left the core, so block b's products are made
// while the vector units scale block b - AMX_AHEAD's (a ring of AMX_AHEAD products buffers).
constexpr int64_t AMX_AHEAD = 4;

// Block b's products into its ring slot (tile set by b's parity: AMX_AHEAD is even).
template <int P>
inline void amx_block(const uint8_t* w, const int8_t* xq, int64_t xq_stride, int64_t b,
                      int32_t* c) {
    const uint8_t* blk = w + b * BLOCK;
    prefetch_block(blk);
    const int8_t* xb = xq + b * P * QK;
    int32_t* slot = c + (b % AMX_AHEAD) * (P * 256);
    if (b & 1) {
        PAGEMILL_Q8_AMX_PRODUCTS(4, 5, 7, P, blk, xb, xq_stride, slot);
    } else {
        PAGEMILL_Q8_AMX_PRODUCTS(0, 1, 6, P, blk, xb, xq_stride, slot);
    }
}

// Rows x[0..T) (planes xq, row stride xq_stride bytes; dx [T][s_stride]) against one tile of
// 16 outputs, as tile_rows<T, P> computes it. c: AMX_AHEAD * P * 256 int32 of scratch,
// 64-byte aligned.
template <int T, int P>
void amx_rows(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t xq_stride,
              const float* dx, int64_t s_stride, int32_t* c, float* out /* [T][16] */) {
    __m512 acc[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < std::min(nb, AMX_AHEAD); ++b) amx_block<P>(w, xq, xq_stride, b, c);
    for (int64_t b = 0; b < nb; ++b) {
        const int32_t* cb = c + (b % AMX_AHEAD) * (P * 256);
        const __m512 d =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * BLOCK)));
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
            __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * t));
            if constexpr (P == 2) {
                const __m512 p2 = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 256 + 16 * t));
                p = _mm512_fmadd_ps(p2, _mm512_set1_ps(1.0f / 254.0f), p);
            }
            acc[t] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(dx[t * s_stride + b])),
                                     acc[t]);
        }
        if (b + AMX_AHEAD < nb) amx_block<P>(w, xq, xq_stride, b + AMX_AHEAD, c);
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * ROWS, acc[t]);
}

template <int P, int T = 16>
void amx_dispatch(int tm, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t xq_stride,
                  const float* dx, int64_t s_stride, int32_t* c, float* out) {
    if constexpr (T > 1) {
        if (tm < T) {
            amx_dispatch<P, T - 1>(tm, w, nb, xq, xq_stride, dx, s_stride, c, out);
            return;
        }
    }
    amx_rows<T, P>(w, nb, xq, xq_stride, dx, s_stride, c, out);
}

// gemv<P> on the tiles. xq holds at least ceil(m_rows / 16) * 16 rows (rows past m_rows are
// read by the tiles, and their products dropped).
template <int P>
void amx_gemv(const uint8_t* w, const int8_t* xq, const float* dx, void* y, int dtype,
              int64_t m_rows, int64_t n, int64_t k, int64_t y_stride, int threads) {
    const int64_t nb = k / QK;
    const int64_t tiles = (n + ROWS - 1) / ROWS;
    const int pass = static_cast<int>(std::min<int64_t>(16, m_rows));
    const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
#pragma omp parallel num_threads(team) if (team > 1)
    {
        configure_tiles(pass);
        alignas(64) int32_t c[AMX_AHEAD * P * 256];
        alignas(64) float out[16 * ROWS];
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const uint8_t* wt = w + tile * nb * BLOCK;
            const int64_t rows = std::min<int64_t>(ROWS, n - tile * ROWS);
            for (int64_t m0 = 0; m0 < m_rows; m0 += 16) {
                const int tm = static_cast<int>(std::min<int64_t>(16, m_rows - m0));
                amx_dispatch<P>(tm, wt, nb, xq + m0 * P * k, P * k, dx + m0 * nb, nb, c, out);
                for (int64_t t = 0; t < tm; ++t)
                    store_outputs(out + t * ROWS, y, (m0 + t) * y_stride + tile * ROWS, rows, dtype);
            }
        }
        _tile_release();
    }
}

#else
constexpr int64_t AMX_MIN_ROWS = 0;
bool amx_usable() { return false; }
int64_t amx_rows_setting() { return 0; }
#endif

// ---- AMX-BF16: batches on bf16 weight tiles made from the packed blocks ---------------------
//
// For batches (an LM head over a whole step's rows) the int8 kernels above pay float work per
// row and block of 32 inputs: each block has its own scale, so its integer sums cannot stay
// in a tile. TDPBF16PS keeps fp32 sums in the tile over all of K instead, and the scales go
// into the weights: each block becomes w = d * q in fp32 (exact: an 8-bit integer times an
// fp16 scale), rounded once to bf16 (as a dense bf16 copy made from the tiles holds it; or d
// rounded to bf16 first, as the bf16 embedding a tied head shares holds it), once per call
// and tile of outputs, and meets every row of x rounded to bf16. The result is the dense bf16 product (fp32 sums in another
// order) without the dense copy in memory, and from half its bytes.
// Tiles: see amx_bf16_gemm.h.

#if PAGEMILL_GEMV_ISA == 3 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__linux__)
#define PAGEMILL_Q8_AMX_BF16 1

bool amx_bf16_usable() {
    static const bool ok = pagemill_amx::usable(pagemill_amx::TILE | pagemill_amx::BF16);
    return ok;
}

using pagemill_amx::BF_TILE;
using pagemill_amx::bf16_pass;
using pagemill_amx::bf16_x_tiles;
using pagemill_amx::configure_bf16_tiles;

// One block of a tile (16 outputs) as a bf16 B tile: row kk holds, per output r, the inputs
// 2kk and 2kk + 1 (one 32-bit lane per output). Line j of the block holds inputs 4j + t of
// output r in byte 4r + t, so B rows 2j and 2j + 1 come from line j alone: a byte permute
// puts, for outputs 0-7 (then 8-15), each one's two inputs in the top bytes of two 32-bit
// lanes, already in B order, the rest of each lane zero. A lane is then q * 2^24, converted
// to float exactly and multiplied by d * 2^-24 (the outputs' scales in the same order): the
// exact d * q, which the bf16 conversion rounds once; its two 16-lane halves are the B row.
// (No shifts to sign-extend, no second permute to interleave.) With `bf16_scales` d is first
// rounded to bf16 (then q * d, 16 bits, is still exact): the values a bf16 embedding made by
// dequantizing with scales in bf16 holds, so that a tied head's two large-row paths agree.
struct Q8Unpack {
    __m512i idx[2][2];  // [B row 2j + p][outputs 0-7, 8-15]: byte sources within the line
    __m512i half[2];    // lane sources of the scales, per half of the outputs
    bool bf16_scales;

    explicit Q8Unpack(bool round_scales) : bf16_scales(round_scales) {
        alignas(64) int8_t bytes[64];
        for (int p = 0; p < 2; ++p) {
            for (int h = 0; h < 2; ++h) {
                for (int l = 0; l < 16; ++l) {  // lane l: output 8h + l / 2, input 2p + l % 2
                    for (int b = 0; b < 3; ++b) bytes[4 * l + b] = 0;  // masked off
                    bytes[4 * l + 3] = static_cast<int8_t>(4 * (8 * h + l / 2) + 2 * p + l % 2);
                }
                idx[p][h] = _mm512_load_si512(bytes);
            }
        }
        alignas(64) int32_t lanes[16];
        for (int h = 0; h < 2; ++h) {
            for (int l = 0; l < 16; ++l) lanes[l] = 8 * h + l / 2;
            half[h] = _mm512_load_si512(lanes);
        }
    }
};

inline void unpack_block_bf16(const uint8_t* blk, uint8_t* out, const Q8Unpack& u) {
    constexpr __mmask64 TOP = 0x8888888888888888ull;  // the top byte of each 32-bit lane
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    if (u.bf16_scales) {
        const __m256i top = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(d));
        d = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(top), 16));
    }
    d = _mm512_mul_ps(d, _mm512_set1_ps(1.0f / 16777216.0f));
    const __m512 dh[2] = {_mm512_permutexvar_ps(u.half[0], d),
                          _mm512_permutexvar_ps(u.half[1], d)};
    for (int j = 0; j < 8; ++j) {
        const __m512i raw = _mm512_loadu_si512(blk + SB + 64 * j);
        for (int p = 0; p < 2; ++p) {  // B row 2j + p: inputs 4j + 2p, 4j + 2p + 1
            __m512 f[2];
            for (int h = 0; h < 2; ++h)
                f[h] = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(TOP, u.idx[p][h], raw)),
                    dh[h]);
            _mm512_store_si512(out + 64 * (2 * j + p),
                               reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0])));
        }
    }
}

// A thread's B tiles, made a block at a time in the order they are used (pair of output
// tiles, then tile, then block) into a ring of `slots` pairs, so that the passes over pairs
// already made can make the next ones between their tile instructions (the vector units and
// the matrix unit working side by side).
struct BFeed {
    const uint8_t* w;
    int64_t tiles, nb, pair_bytes, slots, p0;
    uint8_t* bt;
    Q8Unpack unpack;
    int64_t next = 0;   // tile-blocks made, from the thread's first pair
    int64_t limit = 0;  // no further: the ring's slots past it still hold pairs in use
    int64_t num = 1, den = 1, credit = 0;  // num / den blocks made per tick, on average

    uint8_t* pair_tiles(int64_t pair) const { return bt + (pair - p0) % slots * pair_bytes; }

    inline void step() {
        const int64_t per = 2 * nb;
        const int64_t pr = next / per;
        const int64_t h = next % per / nb;
        const int64_t b = next % nb;
        uint8_t* out = pair_tiles(p0 + pr) + (2 * b + h) * BF_TILE;
        const int64_t tile = 2 * (p0 + pr) + h;
        if (tile >= tiles) {
            std::memset(out, 0, BF_TILE);
        } else {
            unpack_block_bf16(w + (tile * nb + b) * BLOCK, out, unpack);
        }
        ++next;
    }
    inline void tick() {
        if (next >= limit) return;
        credit += num;
        for (; credit >= den && next < limit; credit -= den) step();
    }
    void through(int64_t pair) {  // everything up to and including `pair`
        const int64_t need = (pair - p0 + 1) * 2 * nb;
        while (next < need) step();
    }
};

// Blocking. The threads take spans of pairs of output tiles in turn (each weight block is
// made into a B tile once per call) and make them a block at a time between the tile
// instructions of the passes over pairs already made (BFeed). Rows of x pass 32 at a time (2 A tiles; a
// final 1..16 rows use one A tile and half the products), over K in chunks of at most
// BF_KC_BLOCKS blocks: the sums stay in the tiles over a whole chunk, and a chunk as long as
// the K of the layers served here (an LM head's 576, an MLP's 1536) measured faster than
// chunks short enough for a pass's A and B tiles to stay in L1 together, which spill the sums
// to memory and load them back between chunks. Where x in bf16 fits BF_PAIR_X_BYTES, one pair
// at a time meets every row (x from L2, the pair's B tiles reused by every block of rows)
// while the next pair is made. Above it the pairs go in panels of BF_PANEL_BYTES of B tiles
// kept in L2 while every row passes (each block of rows meets the panel's pairs in turn, its
// A tiles reused by all of them), the next panel made over the passes of the current one into
// the other half of a ring of two. Both stream the same bytes from L2 per product, yet a
// pair at a time slows down per row past about 128 rows of an LM head (K 576) on the AMX
// machines measured, where panels keep their speed per row: `benchmarks/gemm_q8_amx.py`
// shows the crossover.
constexpr int64_t BF_PANEL_BYTES = 512 * 1024;
constexpr int64_t BF_KC_BLOCKS = 48;
constexpr int64_t BF_PAIR_X_BYTES = 160 * 1024;
// Spans of output pairs per thread, about, that the threads take in turn.
constexpr int64_t BF_SPANS_PER_THREAD = 8;

void amx_bf16_multiply(int dtype, const void* x, int64_t x_stride, const uint8_t* w, void* y,
                       int64_t y_stride, int64_t m_rows, int64_t n, int64_t k, int threads,
                       bool bf16_scales) {
    const int64_t nb = k / QK;
    const int64_t m_pad = (m_rows + 15) / 16 * 16;
    // x in bf16 as A tiles. Where it fits BF_PAIR_X_BYTES (each thread then reads all of it
    // for every pair, from its own L2) each thread converts all of x for itself inside the
    // one parallel region: a second region's fork and join costs more than the copy, and far
    // more where another process holds one of the cores for a while. Larger x: one copy,
    // split over the threads, read once per panel.
    const bool own_x = m_rows * k * 2 <= BF_PAIR_X_BYTES;
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
    const int64_t pairs = (tiles + 1) / 2;
    const int64_t pair_bytes = nb * 2 * BF_TILE;
    const int64_t chunks = (nb + BF_KC_BLOCKS - 1) / BF_KC_BLOCKS;
    const int64_t kc = (nb + chunks - 1) / chunks;
    const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, pairs)));
    const int64_t panel = m_rows * k * 2 <= BF_PAIR_X_BYTES || m_rows <= 32
                              ? 1
                              : std::max<int64_t>(1, BF_PANEL_BYTES / pair_bytes);
    // Threads take spans of whole panels in turn, not a fixed share each: where another
    // process holds a core for a while, the other thread takes more spans instead of waiting
    // at the end for its twin. A span's first panel is made as its passes reach it (the
    // ring is not yet ahead), so spans stay many panels long where there are pairs enough.
    const int64_t span = panel * std::max<int64_t>(
                                     1, (pairs + BF_SPANS_PER_THREAD * team * panel - 1) /
                                            (BF_SPANS_PER_THREAD * team * panel));
    const int64_t spans = (pairs + span - 1) / span;
    std::atomic<int64_t> next_span{0};
#pragma omp parallel num_threads(team) if (team > 1)
    {
        uint16_t* xb = shared_xb;
        if (own_x) {
            thread_local std::vector<uint16_t> own;
            own.resize(x_elems);
            xb = own.data();
            for (int64_t r = 0; r < m_pad; ++r) bf16_x_tiles(dtype, x, x_stride, m_rows, nb, r, xb);
        }
        // B tiles of two panels, pair by pair: [slots][nb][2][BF_TILE]; then the products per
        // pair between K chunks, [panel][4][16 x 16] fp32.
        const int64_t slots = std::min(span, 2 * panel);
        thread_local std::vector<uint8_t> made;
        const int64_t cbytes = (chunks > 1 ? panel : 1) * 4 * 1024;
        made.resize(static_cast<size_t>(slots * pair_bytes + cbytes + 64));
        uint8_t* bt = reinterpret_cast<uint8_t*>(
            (reinterpret_cast<uintptr_t>(made.data()) + 63) & ~uintptr_t{63});
        float* cbuf = reinterpret_cast<float*>(bt + slots * pair_bytes);
        const Q8Unpack unpack(bf16_scales);
        const int64_t m_blocks = (m_rows + 31) / 32;
        configure_bf16_tiles();
        for (int64_t sp = next_span++; sp < spans; sp = next_span++) {
            const int64_t p0 = sp * span;
            const int64_t p1 = std::min(pairs, p0 + span);
            BFeed feed{w, tiles, nb, pair_bytes, slots, p0, bt, unpack};
            for (int64_t q0 = p0; q0 < p1; q0 += panel) {
                const int64_t q1 = std::min(p1, q0 + panel);
                const int64_t q2 = std::min(p1, q1 + panel);
                feed.limit = (q2 - p0) * 2 * nb;
                // The next panel's blocks spread evenly over this panel's ticks (one per block
                // of K a pass multiplies); what is still missing when a pair is due is made
                // then (`through`: a span's first panel).
                feed.num = (q2 - q1) * 2;
                feed.den = std::max<int64_t>(1, m_blocks * (q1 - q0));
                feed.credit = 0;
                for (int64_t m0 = 0; m0 < m_rows; m0 += 32) {
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
        }
        _tile_release();
    }
}

#else
bool amx_bf16_usable() { return false; }
#endif

// Whether a call of m_rows rows goes to the matrix units when the caller leaves it to us.
bool picks_amx(int64_t m_rows) {
    const int64_t from = amx_rows_setting();
    return from > 0 && m_rows >= from && amx_usable();
}

// amx: -1 the matrix units from AMX_MIN_ROWS rows where usable and not turned off, 0 never,
// 1 always (status 4 where they are not usable).
int run(int dtype, const void* x, int64_t x_stride, const void* w, void* y, int64_t y_stride,
        int64_t m_rows, int64_t n, int64_t k, int threads, int planes, int amx) {
    if (dtype != 0 && dtype != 1) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (planes != 1 && planes != 2) return 3;
    if (amx == 1 && !amx_usable()) return 4;
    if (m_rows == 0 || n == 0) return 0;
    const bool tiles = amx == 1 || (amx == -1 && picks_amx(m_rows));
    threads = std::max(1, threads);
    const int64_t nb = k / QK;
    const int64_t m_alloc = tiles ? (m_rows + 15) / 16 * 16 : m_rows;
    const size_t elt = dtype == 1 ? 2 : 4;
    // Per calling thread, reused across calls.
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> ds;
    thread_local std::vector<int32_t> sums;
    xq.resize(static_cast<size_t>(planes * m_alloc * k));
    ds.resize(static_cast<size_t>(m_rows * nb));
    sums.resize(static_cast<size_t>(planes * m_rows * nb));
    // Raw pointers: inside the parallel regions a thread_local name is each thread's own.
    int8_t* xqp = xq.data();
    float* dx = ds.data();
    int32_t* isum = sums.data();
    const int qthreads = m_rows >= 16 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
    for (int64_t r = 0; r < m_rows; ++r) {
        const void* xr = static_cast<const char*>(x) + r * x_stride * elt;
        if (planes == 2) {
            quantize_row<2>(xr, dtype, k, xqp + 2 * r * k, dx + r * nb, isum + 2 * r * nb);
        } else {
            quantize_row<1>(xr, dtype, k, xqp + r * k, dx + r * nb, isum + r * nb);
        }
    }
    const uint8_t* wb = static_cast<const uint8_t*>(w);
#ifdef PAGEMILL_Q8_AMX
    if (tiles) {
        if (planes == 2) {
            amx_gemv<2>(wb, xqp, dx, y, dtype, m_rows, n, k, y_stride, threads);
        } else {
            amx_gemv<1>(wb, xqp, dx, y, dtype, m_rows, n, k, y_stride, threads);
        }
        return 0;
    }
#endif
    if (planes == 2) {
        const int16_t* x16p = nullptr;
#if PAGEMILL_GEMV_ISA == 1
        thread_local std::vector<int16_t> x16;
        x16.resize(static_cast<size_t>(m_rows * k));
        widen_planes(xqp, m_rows, k, x16.data());
        x16p = x16.data();
#endif
        gemv<2>(wb, xqp, dx, isum, y, dtype, m_rows, n, k, y_stride, threads, x16p);
    } else {
        gemv<1>(wb, xqp, dx, isum, y, dtype, m_rows, n, k, y_stride, threads);
    }
    return 0;
}

}  // namespace

extern "C" {

// Which arithmetic this build runs (PAGEMILL_GEMV_ISA's values).
int pagemill_gemv_q8_isa() { return PAGEMILL_GEMV_ISA; }

// dtype: 0 fp32, 1 bf16 (x and y). planes: 1 (x rounded to int8 per block) or 2 (plus its
// remainder in a second int8 plane). x [m_rows, k] with row stride x_stride (elements),
// y [m_rows, n] with row stride y_stride. Returns 0, or a nonzero status for arguments it
// refuses.
int pagemill_gemv_q8(int dtype, const void* x, int64_t x_stride, const void* w, void* y,
                     int64_t y_stride, int64_t m_rows, int64_t n, int64_t k, int threads,
                     int planes) {
    return run(dtype, x, x_stride, w, y, y_stride, m_rows, n, k, threads, planes, -1);
}

// pagemill_gemv_q8 on a chosen kernel (amx 0: the vector kernel, 1: the matrix units,
// status 4 where they are not usable), for tests and benchmarks.
int pagemill_gemv_q8_path(int dtype, const void* x, int64_t x_stride, const void* w, void* y,
                          int64_t y_stride, int64_t m_rows, int64_t n, int64_t k, int threads,
                          int planes, int amx) {
    return run(dtype, x, x_stride, w, y, y_stride, m_rows, n, k, threads, planes, amx != 0);
}

// Whether the matrix units serve here (build, CPU and kernel permission; not the switch).
int pagemill_gemv_q8_amx_available() { return amx_usable() ? 1 : 0; }

// Whether pagemill_gemv_q8 runs a call of m_rows rows on the matrix units (this build, this
// machine, PAGEMILL_CPU_GEMV_AMX now).
int pagemill_gemv_q8_picks_amx(int64_t m_rows) { return picks_amx(m_rows) ? 1 : 0; }

// The fewest rows of x the automatic choice sends to the matrix units (0 without them).
int64_t pagemill_gemv_q8_amx_min_rows() { return amx_usable() ? amx_rows_setting() : 0; }

// Whether pagemill_gemm_q8_amx runs here: AMX-BF16 in this build and on this machine, and the
// kernel's permission for the tiles' state.
int pagemill_gemm_q8_amx_available() { return amx_bf16_usable() ? 1 : 0; }

// y = x · Wᵀ on the AMX-BF16 tiles, for batches: each weight block made into bf16 (d * q,
// rounded once; with bf16_scales d rounded to bf16 first) and x rounded to bf16, fp32 sums
// (the dense bf16 product without a dense copy). Arguments as pagemill_gemv_q8's without
// planes; status 4 where AMX-BF16 is not available (pagemill_gemm_q8_amx_available).
int pagemill_gemm_q8_amx(int dtype, const void* x, int64_t x_stride, const void* w, void* y,
                         int64_t y_stride, int64_t m_rows, int64_t n, int64_t k, int threads,
                         int bf16_scales) {
    if (dtype != 0 && dtype != 1) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (!amx_bf16_usable()) return 4;
    if (m_rows == 0 || n == 0) return 0;
#ifdef PAGEMILL_Q8_AMX_BF16
    amx_bf16_multiply(dtype, x, x_stride, static_cast<const uint8_t*>(w), y, y_stride, m_rows, n,
                      k, std::max(1, threads), bf16_scales != 0);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)y, (void)y_stride, (void)threads, (void)bf16_scales;
    return 4;
#endif
}

}  // extern "C"
