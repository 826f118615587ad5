// y[M, N] = x[M, K] · W[N, K]ᵀ over 4-bit weight blocks, with the activations quantized to
// int8 per block of 32 and the dot products done in integers (the way llama.cpp runs Q4_1
// against Q8_1): a few rows of x (decode steps) are bound by reading W, and an int4 block
// whose scale and min sit next to its 16 bytes of nibbles is read once, in one stream, per
// output row.
//
// Weight block (one per 32 inputs of one output row), `S` = uint16_t (fp16) or float:
//     S d; S m; uint8_t qs[16];     w[j] = d * q[j] + m
// with q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4 (j < 16). fp16 holds GGUF's Q4_0/Q4_1
// scales exactly; rows whose scales fp16 cannot hold (Q4_K's d * sc, requantized rows) use
// fp32 blocks.
//
// Activation block: xq[j] = round(x[j] / dx) in -127..127 with dx = max|x| / 127, plus the
// block's exact float sum sx, so that
//     sum_j x[j] w[j] ≈ d * dx * sum_j q[j] xq[j] + m * sx.
// Only the d term sees the int8 rounding; the min term is exact.
//
// Three builds of the same arithmetic (integer sums are exact in each, so they differ only
// in float summation order): AVX512-VNNI / AVX-VNNI (`vpdpbusd`: u8 × s8 → i32), AVX2
// (`vpmaddubsw` + `vpmaddwd`; 15 * 127 * 2 fits int16, nothing saturates), plain C++.
// PAGEMILL_GEMV_ISA forces one (0 plain, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI) for tests.
//
// Built at run time by pagemill.kernels.gemv_q4_cpu (host compiler, -O3 -march=native
// -fopenmp, no torch headers) and called through ctypes. Output rows are split over
// OpenMP threads; up to four rows of x share each weight block while it is in registers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
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
constexpr int MAX_TILE = 4;

template <typename S>
struct Block {
    S d;
    S m;
    uint8_t qs[QK / 2];
};
static_assert(sizeof(Block<uint16_t>) == 20, "fp16 block layout");
static_assert(sizeof(Block<float>) == 24, "fp32 block layout");

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

// One row of x quantized: xq [K] int8, dx and sx [K / 32].
void quantize_row(const void* x, int dtype, int64_t k, int8_t* xq, float* dx, float* sx) {
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
        for (int j = 0; j < QK; ++j) {
            xq[b * QK + j] = static_cast<int8_t>(std::nearbyint(buf[j] * inv));
        }
        dx[b] = d;
        sx[b] = sum;
    }
}

#if PAGEMILL_GEMV_ISA >= 1
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if PAGEMILL_GEMV_ISA == 3
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif PAGEMILL_GEMV_ISA == 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
#endif

// Rows x[0..T) of the tile against one output row's `nb` blocks.
template <typename S, int T>
void row_tile(const Block<S>* w, int64_t nb, const int8_t* xq, int64_t xq_stride,
              const float* dx, const float* sx, int64_t s_stride, float* out) {
    float mins[T];
    for (int t = 0; t < T; ++t) mins[t] = 0.0f;
#if PAGEMILL_GEMV_ISA >= 1
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const float d = scale_value(w[b].d);
        const float m = scale_value(w[b].m);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].qs));
        const __m128i lo = _mm_and_si128(raw, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        const __m256i wv = _mm256_set_m128i(hi, lo);
        for (int t = 0; t < T; ++t) {
            const __m256i xv = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xq + t * xq_stride + b * QK));
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wv, xv));
            acc[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx[t * s_stride + b]), acc[t]);
            mins[t] += m * sx[t * s_stride + b];
        }
    }
    for (int t = 0; t < T; ++t) out[t] = hsum(acc[t]) + mins[t];
#else
    float acc[T];
    for (int t = 0; t < T; ++t) acc[t] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const float d = scale_value(w[b].d);
        const float m = scale_value(w[b].m);
        for (int t = 0; t < T; ++t) {
            const int8_t* xb = xq + t * xq_stride + b * QK;
            int32_t dot = 0;
            for (int j = 0; j < QK / 2; ++j) {
                dot += static_cast<int32_t>(w[b].qs[j] & 15) * xb[j];
                dot += static_cast<int32_t>(w[b].qs[j] >> 4) * xb[j + QK / 2];
            }
            acc[t] += d * dx[t * s_stride + b] * static_cast<float>(dot);
            mins[t] += m * sx[t * s_stride + b];
        }
    }
    for (int t = 0; t < T; ++t) out[t] = acc[t] + mins[t];
#endif
}

template <typename S>
void gemv(const Block<S>* w, const int8_t* xq, const float* dx, const float* sx, void* y,
          int dtype, int64_t m_rows, int64_t n, int64_t k, int64_t y_stride, int threads) {
    const int64_t nb = k / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < n; ++r) {
        const Block<S>* wr = w + r * nb;
        for (int64_t m0 = 0; m0 < m_rows; m0 += MAX_TILE) {
            float out[MAX_TILE];
            const int64_t tile = std::min<int64_t>(MAX_TILE, m_rows - m0);
            const int8_t* xt = xq + m0 * k;
            const float* dt = dx + m0 * nb;
            const float* st = sx + m0 * nb;
            switch (tile) {
                case 4: row_tile<S, 4>(wr, nb, xt, k, dt, st, nb, out); break;
                case 3: row_tile<S, 3>(wr, nb, xt, k, dt, st, nb, out); break;
                case 2: row_tile<S, 2>(wr, nb, xt, k, dt, st, nb, out); break;
                default: row_tile<S, 1>(wr, nb, xt, k, dt, st, nb, out); break;
            }
            for (int64_t t = 0; t < tile; ++t) {
                const int64_t i = (m0 + t) * y_stride + r;
                if (dtype == 1) {
                    static_cast<uint16_t*>(y)[i] = float_to_bf16(out[t]);
                } else {
                    static_cast<float*>(y)[i] = out[t];
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// Which arithmetic this build runs (PAGEMILL_GEMV_ISA's values).
int pagemill_gemv_q4_isa() { return PAGEMILL_GEMV_ISA; }

// dtype: 0 fp32, 1 bf16 (x and y). scale_bytes: 2 (fp16 blocks) or 4 (fp32 blocks).
// x [m_rows, k] with row stride x_stride (elements), y [m_rows, n] with row stride y_stride.
// Returns 0, or a nonzero status for arguments it refuses.
int pagemill_gemv_q4(int dtype, const void* x, int64_t x_stride, const void* w, int scale_bytes,
                     void* y, int64_t y_stride, int64_t m_rows, int64_t n, int64_t k,
                     int threads) {
    if ((dtype != 0 && dtype != 1) || (scale_bytes != 2 && scale_bytes != 4)) return 1;
    if (k % QK != 0 || m_rows < 0 || n < 0) return 2;
    if (m_rows == 0 || n == 0) return 0;
    threads = std::max(1, threads);
    const int64_t nb = k / QK;
    const size_t elt = dtype == 1 ? 2 : 4;
    // Per calling thread, reused: one decode step calls this ~120 times with few rows.
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> ds;
    xq.resize(static_cast<size_t>(m_rows * k));
    ds.resize(static_cast<size_t>(2 * m_rows * nb));
    // Raw pointers: inside the parallel regions a thread_local name is each thread's own.
    int8_t* xqp = xq.data();
    float* dx = ds.data();
    float* sx = ds.data() + m_rows * nb;
    const int qthreads = m_rows >= 16 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
    for (int64_t r = 0; r < m_rows; ++r) {
        quantize_row(static_cast<const char*>(x) + r * x_stride * elt, dtype, k,
                     xqp + r * k, dx + r * nb, sx + r * nb);
    }
    if (scale_bytes == 2) {
        gemv(static_cast<const Block<uint16_t>*>(w), xqp, dx, sx, y, dtype, m_rows, n, k,
             y_stride, threads);
    } else {
        gemv(static_cast<const Block<float>*>(w), xqp, dx, sx, y, dtype, m_rows, n, k,
             y_stride, threads);
    }
    return 0;
}

}  // extern "C"
