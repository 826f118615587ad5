// Paged decode attention on CPU: one query token per request, K/V read in place from the
// paged cache through the block table (no gathered copy), softmax in fp32.
//
// Built at run time by pagemill.kernels.cpu_native with the host's compiler (-O3
// -march=native -fopenmp) and called through ctypes with raw pointers, so it needs no
// torch headers (seconds to compile, not a minute). Work is split over (request, KV head)
// pairs; each pair reads its K/V once for all the query heads that share the KV head
// (GQA). A batch of few pairs (one or two requests) on the AVX-512 path cuts each context
// into parts of whole blocks, so every thread has work: each part keeps its own softmax
// state (max, sum, unnormalised output) and the parts merge in order after the parallel
// loop; the cut depends on the batch alone, so the result does not depend on the threads.
// The portable path walks one block at a time with an online softmax; the AVX-512
// path (below) takes chunks of up to a few thousand tokens in three passes: all scores,
// then the weights, then the weighted V rows, and so does the AVX2 path (`avx2::`, head
// dims 64 and 128 on a CPU without AVX-512) in 256-bit vectors. A sliding window (window > 0: the last `window`
// positions) starts the walk at the window's first block and skips the positions before
// it; a soft-cap (softcap > 0) maps each scaled score s to softcap * tanh(s / softcap).
// An 8-bit cache (kv_lut non-null: fp8 or int8) is read as bytes, through a 256-entry table
// of the format's values or, on the AVX-512 path under a bf16 query, by their bits
// (kv_format); its scales fold into the query (k_scale) and the output (v_scale) of each
// (request, KV head) pair: KV head h reads k_scales[h * scale_stride] (stride 0: the layer's
// one scale, 1: one per KV head).
// Attention sinks (sinks non-null: one fp32 logit per query head, gpt-oss) start each
// head's online softmax as if the sink were a first key with a zero value: max = sink,
// sum = 1, so the sink is in the denominator and nowhere else.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

inline float half_to_float(uint16_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 1;
            while (!(mant & 0x400u)) { mant <<= 1; --exp; }
            mant &= 0x3ffu;
            bits = sign | ((exp + 112u) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_half(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000u;
    int32_t exp = static_cast<int32_t>((bits >> 23) & 0xffu) - 127 + 15;
    uint32_t mant = bits & 0x7fffffu;
    if (((bits >> 23) & 0xffu) == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
    if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
    if (exp <= 0) {
        if (exp < -10) return static_cast<uint16_t>(sign);
        mant |= 0x800000u;
        uint32_t shift = static_cast<uint32_t>(14 - exp);
        uint32_t half_mant = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half_mant & 1u))) ++half_mant;
        return static_cast<uint16_t>(sign | half_mant);
    }
    uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
    return static_cast<uint16_t>(half);
}

// dtype codes: 0 = float32, 1 = bfloat16, 2 = float16.
template <int DT> struct Elem;
template <> struct Elem<0> {
    using T = float;
    static inline float load(const T* p, int64_t i) { return p[i]; }
    static inline void store(T* p, int64_t i, float v) { p[i] = v; }
};
template <> struct Elem<1> {
    using T = uint16_t;
    static inline float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
    static inline void store(T* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
};
template <> struct Elem<2> {
    using T = uint16_t;
    static inline float load(const T* p, int64_t i) { return half_to_float(p[i]); }
    static inline void store(T* p, int64_t i, float v) { p[i] = float_to_half(v); }
};

// How K/V are stored (the kernels' FP8 template argument, the C entry's kv_format): in the
// compute dtype, or 8-bit codes read through the format's table (any byte format) or by
// their bits (float8_e4m3fn, float8_e5m2, int8; the AVX-512 path under a bf16 query only:
// other queries and the portable path read every byte format through the table).
constexpr int kNoBytes = 0, kTableBytes = 1, kE4M3 = 2, kE5M2 = 3, kInt8 = 4;

// K/V element access: the compute dtype's own, or fp8 bytes decoded through a table.
template <int DT, bool BYTES> struct KVLoad;
template <int DT> struct KVLoad<DT, false> {
    using T = typename Elem<DT>::T;
    static inline float load(const T* p, int64_t i, const float*) { return Elem<DT>::load(p, i); }
};
template <int DT> struct KVLoad<DT, true> {
    using T = uint8_t;
    static inline float load(const T* p, int64_t i, const float* lut) { return lut[p[i]]; }
};

constexpr int kMaxBlock = 256;    // largest block_size and head_dim served here

// With PAGEMILL_DECODE_PROFILE defined (benchmarks/attention_cpu.py builds such a copy),
// the fast path counts the calling thread's TSC cycles per phase: 0 setup (q, state),
// 1 scores, 2 weights, 3 weighted values, 4 output or partial state, 5 merge of parts,
// 6 whole calls; 7 counts the pairs (or parts) decoded. Read with pagemill_paged_decode_profile.
#if defined(PAGEMILL_DECODE_PROFILE)
}  // namespace
#include <x86intrin.h>
namespace {
thread_local double g_prof[8];
#define PROF_BEGIN() uint64_t prof_t = __rdtsc()
#define PROF(i)                                  \
    do {                                         \
        const uint64_t prof_now = __rdtsc();     \
        g_prof[i] += double(prof_now - prof_t);  \
        prof_t = prof_now;                       \
    } while (0)
#define PROF_COUNT(i) (g_prof[i] += 1.0)
#else
#define PROF_BEGIN() (void)0
#define PROF(i) (void)0
#define PROF_COUNT(i) (void)0
#endif
constexpr int kMaxFastGroup = 16;  // larger GQA groups take the generic path
// Batches of fewer (request, KV head) pairs than this split their contexts (decode_all)
// into about this many work items (a multiple of 2, 3 and 4 threads' shares where the
// context is long enough)...
constexpr int kSplitItems = 12;
// ...of at least this many positions each: shorter ones cost more in set-up and merge than
// the second thread saves.
constexpr int kMinPartTokens = 128;

#if defined(__AVX2__) && defined(__FMA__)
// exp for 8 lanes of x <= 0 (scores minus their running max), as the AVX-512 path's exp_neg:
// lanes below -87.3 give 0; Cody-Waite reduction to |r| <= ln2/2, a degree-6 polynomial
// (under 2 ulp from expf), and 2^n built in the exponent bits (n in -126..0: normal).
inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEMILL_DECODE_AVX2 1
// The AVX2 path, for head dims 64 and 128 on a CPU without AVX-512 and a cache in the
// compute dtype (8-bit caches take the portable path). As the AVX-512 path, a (request, KV
// head) pair's context goes in chunks of up to kChunkTokens positions, each in three passes:
//  1. scores: each query head against 8 K rows at a time, one FMA chain per row into its own
//     vector, and one transpose-and-add of the 8 vectors into the 8 scores (instead of a
//     horizontal sum per score); the rows' V lines are asked for towards L2 meanwhile;
//  2. weights: exp(score - max) 8 at a time, their sums, and the earlier chunks' state (or a
//     sink's logit) rescaled to the new maximum;
//  3. values: up to 3 query heads x 32 output elements held in 12 accumulator registers over
//     the whole chunk, each V row's 32 elements loaded once for the heads of the block.
// Nothing is allocated per call once each thread's buffers have grown to the largest chunk.
namespace avx2 {

constexpr int kChunkTokens = 1024;
constexpr int kHeadsPerPass = 3;  // 3 heads x 4 vectors: 12 of the 16 registers
constexpr int kMaxGroup = kMaxFastGroup;
// K rows asked for (towards L1) this many positions ahead of the scores, their V rows
// towards L2; the values pass asks for each row's lines it reads again, kValueLead rows
// ahead (towards L1: by then L2 may have let them go on a long chunk). Leads of 8 to 128 for
// the scores measured alike; the second ask for the V lines measured faster than none.
constexpr int kLeadTokens = 32;
constexpr int kValueLead = 8;

// 8 elements of a row as fp32.
template <int DT>
inline __m256 load8(const typename Elem<DT>::T* p) {
    if constexpr (DT == 0) {
        return _mm256_loadu_ps(p);
    } else if constexpr (DT == 1) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
#if defined(__F16C__)
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
        alignas(32) float f[8];
        for (int i = 0; i < 8; ++i) f[i] = half_to_float(p[i]);
        return _mm256_load_ps(f);
#endif
    }
}

// Lane t of the result is the sum of the 8 lanes of v[t].
inline __m256 transpose_sum8(const __m256* v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline void prefetch_row(const void* row, int64_t bytes, int hint) {
    const char* c = static_cast<const char*>(row);
    for (int64_t l = 0; l < bytes; l += 64) {
        if (hint == 0) {
            _mm_prefetch(c + l, _MM_HINT_T0);
        } else {
            _mm_prefetch(c + l, _MM_HINT_T1);
        }
    }
}

// H query heads' weighted V rows over n positions, output elements [32 * c, 32 * c + 32).
template <int DT, int H>
inline void weigh_values(const typename Elem<DT>::T* const* vrows, int n, const float* s,
                         int64_t s_stride, int c, float* acc, int D) {
    __m256 a[H][4];
    for (int h = 0; h < H; ++h)
        for (int i = 0; i < 4; ++i) a[h][i] = _mm256_loadu_ps(acc + h * D + 32 * c + 8 * i);
    for (int t = 0; t < n; ++t) {
        const auto* vr = vrows[t] + 32 * c;
        if (t + kValueLead < n) {
            const char* pf = reinterpret_cast<const char*>(vrows[t + kValueLead] + 32 * c);
            _mm_prefetch(pf, _MM_HINT_T0);
            if constexpr (sizeof(*vr) == 4) _mm_prefetch(pf + 64, _MM_HINT_T0);
        }
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = load8<DT>(vr + 8 * i);
        for (int h = 0; h < H; ++h) {
            const __m256 w = _mm256_broadcast_ss(s + h * s_stride + t);
            for (int i = 0; i < 4; ++i) a[h][i] = _mm256_fmadd_ps(w, v[i], a[h][i]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + h * D + 32 * c + 8 * i, a[h][i]);
}

template <int DT, int D>
void decode_pair(const typename Elem<DT>::T* q, const typename Elem<DT>::T* k_cache,
                 const typename Elem<DT>::T* v_cache, typename Elem<DT>::T* out,
                 const int32_t* table, int32_t ctx, int64_t q_row, int64_t out_row, int kvh,
                 int group, int block_size, int num_kv_heads, int64_t q_stride_t,
                 int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h, float scale,
                 int window, float softcap, float k_scale, float v_scale, const float* sinks) {
    using E = Elem<DT>;
    using T = typename E::T;
    constexpr int NV = D / 8;
    constexpr int64_t kRowBytes = D * sizeof(T);
    const int64_t slot_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t block_stride = static_cast<int64_t>(block_size) * slot_stride;
    const int64_t s_stride = kChunkTokens + 8;
    thread_local std::vector<float> buf;
    thread_local std::vector<const T*> rows;
    const size_t need = static_cast<size_t>(group) * (2 * D + s_stride);
    if (buf.size() < need) buf.resize(need);
    if (rows.size() < 2 * static_cast<size_t>(s_stride)) rows.resize(2 * s_stride);
    float* qf = buf.data();
    float* acc = qf + group * D;
    float* sc = acc + group * D;
    const T** krows = rows.data();
    const T** vrows = krows + s_stride;
    alignas(32) static const T kZeroRow[D] = {};
    float m[kMaxGroup], l[kMaxGroup];
    for (int g = 0; g < group; ++g) {
        const T* qp = q + q_row * q_stride_t + static_cast<int64_t>(kvh * group + g) * q_stride_h;
        for (int d = 0; d < D; ++d) qf[g * D + d] = E::load(qp, d) * scale * k_scale;
        for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
        m[g] = sinks ? sinks[kvh * group + g] : -INFINITY;
        l[g] = sinks ? 1.f : 0.f;
    }
    const int start = (window > 0 && ctx > window) ? ctx - window : 0;
    for (int c0 = start; c0 < ctx; c0 += kChunkTokens) {
        const int n = std::min(ctx - c0, kChunkTokens);
        for (int t = 0; t < n; ++t) {
            const int pos = c0 + t;
            const int64_t off = static_cast<int64_t>(table[pos / block_size]) * block_stride +
                                (pos % block_size) * slot_stride + kvh * D;
            krows[t] = k_cache + off;
            vrows[t] = v_cache + off;
        }
        for (int t = n; t < n + 8; ++t) krows[t] = kZeroRow;
        // 1. scores
        for (int t0 = 0; t0 < n; t0 += 8) {
            if (t0 == 0)
                for (int t = 0; t < std::min(n, kLeadTokens); ++t) prefetch_row(krows[t], kRowBytes, 0);
            for (int t = t0 + kLeadTokens; t < std::min(n, t0 + kLeadTokens + 8); ++t) {
                prefetch_row(krows[t], kRowBytes, 0);
                prefetch_row(vrows[t], kRowBytes, 1);
            }
            if (t0 == 0)
                for (int t = 0; t < std::min(n, kLeadTokens); ++t) prefetch_row(vrows[t], kRowBytes, 1);
            for (int g = 0; g < group; ++g) {
                const float* qg = qf + g * D;
                __m256 part[8];
                for (int t = 0; t < 8; ++t) part[t] = _mm256_setzero_ps();
                for (int i = 0; i < NV; ++i) {
                    const __m256 qv = _mm256_loadu_ps(qg + 8 * i);
                    for (int t = 0; t < 8; ++t)
                        part[t] = _mm256_fmadd_ps(qv, load8<DT>(krows[t0 + t] + 8 * i), part[t]);
                }
                _mm256_storeu_ps(sc + g * s_stride + t0, transpose_sum8(part));
            }
        }
        if (softcap > 0.f) {
            const float inv_cap = 1.f / softcap;
            for (int g = 0; g < group; ++g)
                for (int t = 0; t < n; ++t) {
                    float& x = sc[g * s_stride + t];
                    x = softcap * std::tanh(x * inv_cap);
                }
        }
        // 2. weights
        for (int g = 0; g < group; ++g) {
            float* sg = sc + g * s_stride;
            __m256 vmax = _mm256_set1_ps(m[g]);
            int t = 0;
            for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + t));
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, vmax);
            float bmax = m[g];
            for (int i = 0; i < 8; ++i) bmax = lanes[i] > bmax ? lanes[i] : bmax;
            for (; t < n; ++t) bmax = sg[t] > bmax ? sg[t] : bmax;
            const float alpha = std::exp(m[g] - bmax);
            vmax = _mm256_set1_ps(bmax);
            __m256 vsum = _mm256_setzero_ps();
            for (t = 0; t + 8 <= n; t += 8) {
                const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmax));
                _mm256_storeu_ps(sg + t, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            _mm256_store_ps(lanes, vsum);
            float sum = 0.f;
            for (int i = 0; i < 8; ++i) sum += lanes[i];
            for (; t < n; ++t) {
                sg[t] = std::exp(sg[t] - bmax);
                sum += sg[t];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = bmax;
            const __m256 va = _mm256_set1_ps(alpha);
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + g * D + d, _mm256_mul_ps(va, _mm256_loadu_ps(acc + g * D + d)));
        }
        // 3. values
        for (int g0 = 0; g0 < group; g0 += kHeadsPerPass) {
            const int h = std::min(kHeadsPerPass, group - g0);
            for (int c = 0; c < D / 32; ++c) {
                const float* sg = sc + g0 * s_stride;
                float* ag = acc + g0 * D;
                if (h == 3) {
                    weigh_values<DT, 3>(vrows, n, sg, s_stride, c, ag, D);
                } else if (h == 2) {
                    weigh_values<DT, 2>(vrows, n, sg, s_stride, c, ag, D);
                } else {
                    weigh_values<DT, 1>(vrows, n, sg, s_stride, c, ag, D);
                }
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        T* op = out + out_row * o_stride_t + static_cast<int64_t>(kvh * group + g) * o_stride_h;
        const float inv = l[g] > 0.f ? v_scale / l[g] : 0.f;
        for (int d = 0; d < D; ++d) E::store(op, d, acc[g * D + d] * inv);
    }
}

}  // namespace avx2
#endif

template <int DT, int FP8, int HEAD_DIM>
void decode_pair(const typename Elem<DT>::T* q, const typename KVLoad<DT, (FP8 != 0)>::T* k_cache,
                 const typename KVLoad<DT, (FP8 != 0)>::T* v_cache, typename Elem<DT>::T* out,
                 const int32_t* table, int32_t ctx, int64_t q_row, int64_t out_row,
                 int kvh, int group, int head_dim, int block_size, int num_kv_heads,
                 int64_t q_stride_t, int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                 float scale, int window, float softcap, const float* lut, float k_scale,
                 float v_scale, const float* sinks) {
    using E = Elem<DT>;
    using KV = KVLoad<DT, (FP8 != 0)>;
    const int D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
    const int64_t slot_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t block_stride = static_cast<int64_t>(block_size) * slot_stride;
    std::vector<float> qf(static_cast<size_t>(group) * D), acc(static_cast<size_t>(group) * D, 0.f);
    std::vector<float> m(group, -INFINITY), l(group, 0.f), s(static_cast<size_t>(group) * block_size);
    for (int g = 0; g < group; ++g) {
        const auto* qp = q + q_row * q_stride_t + static_cast<int64_t>(kvh * group + g) * q_stride_h;
        for (int d = 0; d < D; ++d) qf[g * D + d] = E::load(qp, d) * scale * k_scale;
        if (sinks) {
            m[g] = sinks[kvh * group + g];
            l[g] = 1.f;
        }
    }
    const int num_blocks = (ctx + block_size - 1) / block_size;
    const int start = (window > 0 && ctx > window) ? ctx - window : 0;
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
    for (int b = start / block_size; b < num_blocks; ++b) {
        const int n = (b == num_blocks - 1) ? ctx - b * block_size : block_size;
        const int t0 = (b == start / block_size) ? start - b * block_size : 0;
        const auto* kb = k_cache + static_cast<int64_t>(table[b]) * block_stride + kvh * D;
        const auto* vb = v_cache + static_cast<int64_t>(table[b]) * block_stride + kvh * D;
        for (int t = t0; t < n; ++t) {
            const auto* kt = kb + t * slot_stride;
            float kf[HEAD_DIM > 0 ? HEAD_DIM : kMaxBlock];
            for (int d = 0; d < D; ++d) kf[d] = KV::load(kt, d, lut);
            for (int g = 0; g < group; ++g) {
                const float* qg = &qf[g * D];
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];
                if (softcap > 0.f) dot = softcap * std::tanh(dot * inv_cap);
                s[g * block_size + t] = dot;
            }
        }
        for (int g = 0; g < group; ++g) {
            float* sg = &s[g * block_size];
            float bmax = m[g];
            for (int t = t0; t < n; ++t) bmax = sg[t] > bmax ? sg[t] : bmax;
            const float alpha = std::exp(m[g] - bmax);
            float sum = 0.f;
            int t = t0;
#if defined(__AVX2__) && defined(__FMA__)
            // A block's weights 8 at a time: a scalar exp per score was most of this loop.
            __m256 vsum = _mm256_setzero_ps();
            const __m256 vmax = _mm256_set1_ps(bmax);
            for (; t + 8 <= n; t += 8) {
                const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmax));
                _mm256_storeu_ps(sg + t, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, vsum);
            for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
            for (; t < n; ++t) {
                sg[t] = std::exp(sg[t] - bmax);
                sum += sg[t];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = bmax;
            float* ag = &acc[g * D];
#pragma omp simd
            for (int d = 0; d < D; ++d) ag[d] *= alpha;
        }
        for (int t = t0; t < n; ++t) {
            const auto* vt = vb + t * slot_stride;
            float vf[HEAD_DIM > 0 ? HEAD_DIM : kMaxBlock];
            for (int d = 0; d < D; ++d) vf[d] = KV::load(vt, d, lut);
            for (int g = 0; g < group; ++g) {
                const float p = s[g * block_size + t];
                float* ag = &acc[g * D];
#pragma omp simd
                for (int d = 0; d < D; ++d) ag[d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        auto* op = out + out_row * o_stride_t + static_cast<int64_t>(kvh * group + g) * o_stride_h;
        const float inv = l[g] > 0.f ? v_scale / l[g] : 0.f;
        for (int d = 0; d < D; ++d) E::store(op, d, acc[g * D + d] * inv);
    }
}


#if defined(__AVX512F__)
// The AVX-512 path, for head dims 64 and 128. Per (request, KV head) pair the context is
// taken in chunks of whole blocks (up to kChunkTokens tokens), each in three passes, so no
// step waits on a reduction or an exp per tile:
//  1. scores: every query head of the group dots the K rows of a tile of 16 tokens straight
//     from the cache (bf16 with AVX512-BF16: `vdpbf16ps` on the raw rows, exact products
//     summed in fp32, the softmax scale applied to the fp32 score; fp32: FMAs; fp16/fp8:
//     the tile widened to fp32 once into a stack scratch, so the group shares one
//     conversion), one FMA chain per token and one transpose-and-add of the 16 partial
//     vectors; the scores go to a per-thread buffer, and a running maximum per head;
//  2. weights: exp(score - max) over the chunk, vectorised, and their sums; the state of
//     earlier chunks (or a sink's logit) rescaled to the new maximum;
//  3. values: the query heads in register blocks (accumulators held in registers for the
//     whole chunk), each V row loaded and widened once per block of heads; bf16 rows widen
//     with one shift (even elements) and one mask (odd elements), so the accumulators hold
//     each 32-wide chunk as its even then its odd half, put back in order at the end.
// Blocks lie anywhere in the pool, so the hardware prefetchers cannot follow them: each
// thread takes runs of consecutive pairs and keeps a stream of prefetches (`Stream`) a fixed
// number of rows ahead of the rows it reads, through the ends of blocks and pairs, one row
// asked for per row read, so the memory traffic overlaps the arithmetic instead of
// alternating with it. The output is rounded and stored 16 lanes at a time. Nothing is
// allocated per call once each thread's score buffer has grown to its largest chunk.
namespace fast {

template <int DT, int FP8> struct Row;
template <> struct Row<0, kNoBytes> {
    static inline __m512 load(const void* p, const float*) { return _mm512_loadu_ps(p); }
};
template <> struct Row<1, kNoBytes> {
    static inline __m512 load(const void* p, const float*) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
};
template <> struct Row<2, kNoBytes> {
    static inline __m512 load(const void* p, const float*) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    }
};
// An 8-bit cache through its table: any byte format (the portable path's way).
template <int DT> struct Row<DT, kTableBytes> {
    static inline __m512 load(const void* p, const float* lut) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
        return _mm512_i32gather_ps(idx, lut, 4);
    }
};
// The formats by their bits, a few instructions per 16 bytes where a gather takes 16 loads.
// e4m3fn: sign and the 7 other bits moved into an fp16 (exponent bias 15 instead of 7, so
// the fp16 holds the value / 2^8, subnormals included, exactly) and widened by vcvtph2ps,
// which DAZ does not touch; the two NaN patterns (S.1111.111) kept NaN, as the table has them.
template <int DT> struct Row<DT, kE4M3> {
    static inline __m512 load(const void* p, const float*) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
        const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
        return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(NAN));
    }
};
// e5m2 is the top byte of an fp16 (inf and NaN included).
template <int DT> struct Row<DT, kE5M2> {
    static inline __m512 load(const void* p, const float*) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
        return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    }
};
template <int DT> struct Row<DT, kInt8> {
    static inline __m512 load(const void* p, const float*) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
    }
};

// exp for x <= 0 (scores minus their running max); lanes below -87.3 give 0. Cody-Waite
// range reduction to |r| <= ln2/2, then a degree-6 polynomial: under 2 ulp from expf.
inline __m512 exp_neg(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 transpose_sum(const __m512* v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

// 32 bf16 loaded as a vdpbf16ps operand. Cast from an integer vector instead
// (`(__m512bh)_mm512_loadu_si512(p)`), GCC 12 stores every loaded vector to the stack and
// reloads it: a store and a dependent reload per K row of the score loop.
inline __m512bh load_bh(const void* p) {
    typedef __m512bh m512bh_u __attribute__((aligned(1), may_alias));
    return *static_cast<const m512bh_u*>(p);
}

constexpr int kTile = 16;
constexpr int kMaxGroup = kMaxFastGroup;
// What the score loop reads for the rows past a partial tile (a fp32 row of the largest D).
alignas(64) constexpr char kZeros[512] = {};

// bf16 K dotted in place with vdpbf16ps (needs AVX512-BF16); other dtypes as fp32.
template <int DT, int FP8>
constexpr bool kDirectBf16 =
#if defined(__AVX512BF16__)
    DT == 1 && !FP8;
#else
    false;
#endif
// K rows the FMAs read in place (fp32 cache, or bf16 through vdpbf16ps); others are widened
// into the tile scratch first.
template <int DT, int FP8>
constexpr bool kKInPlace = (DT == 0 && !FP8) || kDirectBf16<DT, FP8>;
// bf16 V rows widened in place by shift/mask (the accumulators' even/odd order).
template <int DT, int FP8>
constexpr bool kVEvenOdd = DT == 1 && !FP8;

// A V row's 16*NV elements as fp32, in the accumulators' order.
template <int DT, int FP8, int NV>
inline void load_v(const char* row, const float* lut, __m512* v) {
    if constexpr (kVEvenOdd<DT, FP8>) {
        const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        for (int c = 0; c < NV / 2; ++c) {
            const __m512i w = _mm512_loadu_si512(row + 64 * c);
            v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
        }
    } else {
        constexpr int64_t esize = FP8 ? 1 : (DT == 0 ? 4 : 2);
        for (int c = 0; c < NV; ++c) v[c] = Row<DT, FP8>::load(row + 16 * c * esize, lut);
    }
}

// Rows of one KV head in a block, K or V, asked for ahead of use (towards L1).
inline void prefetch_rows(const char* base, int32_t block, int64_t block_bytes, int64_t slot_bytes,
                          int tokens, int64_t row_bytes) {
    const char* p = base + static_cast<int64_t>(block) * block_bytes;
    for (int t = 0; t < tokens; ++t)
        for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(p + t * slot_bytes + o, _MM_HINT_T0);
}

// fp32 lanes rounded to bf16 (nearest even; NaN kept quiet) as float_to_bf16 does, the
// result in the high 16 bits of each lane.
inline __m512i bf16_round(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
}

// Blocks asked for ahead of the one being read (more did not help where measured: the
// prefetches themselves cost, and one block's work covers most of a block's latency).
constexpr int kAhead = 1;

// The first kAhead K blocks of a pair, asked for while the pair before it runs (where no
// stream runs ahead: a GQA group over kMaxGroup).
inline void prefetch_pair(const void* k_cache, const int32_t* table, int32_t ctx, int kvh,
                          int block_size, int num_kv_heads, int64_t row_bytes, int window) {
    const int64_t slot_bytes = num_kv_heads * row_bytes, block_bytes = block_size * slot_bytes;
    const int start = (window > 0 && ctx > window) ? ctx - window : 0;
    const int num_blocks = (ctx + block_size - 1) / block_size;
    for (int b = start / block_size; b < std::min(num_blocks, start / block_size + kAhead); ++b)
        prefetch_rows(static_cast<const char*>(k_cache) + kvh * row_bytes, table[b], block_bytes,
                      slot_bytes, std::min(block_size, ctx - b * block_size), row_bytes);
}

// Tokens of one pass: the scores of a chunk of this many blocks' tokens are held at once.
constexpr int kChunkTokens = 2048;

// Rows the stream runs ahead of the rows being read (a longer lead holds more fill buffers
// at once and measured no better).
constexpr int kLead = 96;

// Positions [begin, end) of part `part` of a context cut into `parts` runs of whole blocks
// from the window's first block (the whole window when parts is 1); begin == end: nothing
// to read.
inline void part_range(int ctx, int window, int block_size, int parts, int part, int& begin,
                       int& end) {
    const int start = (window > 0 && ctx > window) ? ctx - window : 0;
    begin = start;
    end = ctx;
    if (parts <= 1) return;
    const int first = start / block_size;
    const int64_t nb = (ctx + block_size - 1) / block_size - first;
    begin = std::max(start, static_cast<int>(first + nb * part / parts) * block_size);
    end = std::min(ctx, static_cast<int>(first + nb * (part + 1) / parts) * block_size);
    if (begin >= end) begin = end = 0;
}

// The K/V rows a thread will read next, asked for one row for each row it reads, a lead of
// rows ahead. Asking for a whole block or pair at once stalls the core as loads would (each
// prefetch waits for a fill buffer) while the compute waits behind them; paced, the
// requests overlap the arithmetic. They go towards L2 (PREFETCHT1), not L1: the rows a lead
// ahead would crowd the rows being read out of L1, and from L2 the loads wait little. The
// stream walks the thread's pairs in the order decode_pair reads them: per chunk of a pair,
// its K rows then its V rows, from the window's first position. The thread's work items are
// (pair, part) in that order, `parts` per pair (part_range).
struct Stream {
    const char* k_cache;
    const char* v_cache;
    const int32_t* tables;
    int64_t table_stride;
    const int32_t* lens;
    int num_kv_heads, block_size, window;
    int64_t row_bytes, slot_bytes, block_bytes;
    int parts = 1;
    int64_t pair = 0, end = 0;  // work items: pair * parts + part
    const int32_t* table = nullptr;
    const char* base = nullptr;  // K or V of the pair's KV head
    const char* cur = nullptr;   // the block being asked for
    int ctx = 0, num_blocks = 0, first_tok = 0, chunk_b0 = 0, block = 0, tok = 0, ntok = 0;
    bool values = false;

    void open(int64_t p) {
        int begin = 0, stop = 0;
        for (pair = p; pair < end; ++pair) {  // items without context read nothing
            part_range(lens[pair / parts / num_kv_heads], window, block_size, parts,
                       static_cast<int>(pair % parts), begin, stop);
            if (stop > begin) break;
        }
        if (pair >= end) return;
        ctx = stop;
        table = tables + (pair / parts / num_kv_heads) * table_stride;
        num_blocks = (ctx + block_size - 1) / block_size;
        chunk_b0 = begin / block_size;
        first_tok = begin - chunk_b0 * block_size;
        values = false;
        base = k_cache + (pair / parts % num_kv_heads) * row_bytes;
        seek(chunk_b0, first_tok);
    }
    void seek(int b, int t) {
        block = b;
        tok = t;
        ntok = std::min(block_size, ctx - b * block_size);
        cur = base + static_cast<int64_t>(table[b]) * block_bytes;
    }
    void next_block() {
        const int chunk_end = std::min(num_blocks, chunk_b0 + std::max(1, kChunkTokens / block_size));
        const int64_t to_v = v_cache - k_cache;
        if (block + 1 < chunk_end) {
            seek(block + 1, 0);
        } else if (!values) {
            values = true;
            base += to_v;
            seek(chunk_b0, first_tok);
        } else if (chunk_end < num_blocks) {
            values = false;
            base -= to_v;
            chunk_b0 = chunk_end;
            first_tok = 0;
            seek(chunk_b0, 0);
        } else {
            open(pair + 1);
        }
    }
    inline void row() {
        if (pair >= end) return;
        const char* r = cur + tok * slot_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
        if (++tok >= ntok) next_block();
    }
    inline void rows(int n) {
        for (int i = 0; i < n; ++i) row();
    }
};

// One thread's score buffer, grown (rarely) to the largest chunk it has met, never shrunk.
inline float* score_buffer(size_t floats) {
    thread_local std::vector<float> buf;
    if (buf.size() < floats) buf.resize(floats);
    return buf.data();
}

// A group's outputs from its accumulators (the V pass's element order) and softmax sums.
template <int DT, int FP8, int NV>
void store_out(typename Elem<DT>::T* op, const float* acc, float l, float v_scale) {
    const __m512 inv = _mm512_set1_ps(l > 0.f ? v_scale / l : 0.f);
    if constexpr (kVEvenOdd<DT, FP8>) {
        // Even elements to the low halves of the 32-bit lanes, odd ones to the high.
        const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        for (int c = 0; c < NV / 2; ++c) {
            const __m512i e = bf16_round(_mm512_mul_ps(_mm512_load_ps(acc + 32 * c), inv));
            const __m512i o = bf16_round(_mm512_mul_ps(_mm512_load_ps(acc + 32 * c + 16), inv));
            _mm512_storeu_si512(op + 32 * c, _mm512_or_si512(_mm512_srli_epi32(e, 16), _mm512_and_si512(o, hi)));
        }
    } else {
        for (int c = 0; c < NV; ++c) {
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), inv);
            if constexpr (DT == 0) {
                _mm512_storeu_ps(op + 16 * c, x);
            } else if constexpr (DT == 1) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + 16 * c),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round(x), 16)));
            } else {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + 16 * c),
                                    _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
    }
}

// Floats of one head's partial state: its max, its sum, then its D accumulators (at a
// 64-byte multiple, so the merge loads them aligned).
template <int NV>
constexpr int64_t kStateFloats = 16 + NV * 16;

// Positions [begin, end) of one (request, KV head) pair. With `state` null the group's
// outputs are written; else each head's running max, sum and unnormalised accumulators go
// to state (kStateFloats apart), for merge_parts.
template <int DT, int FP8, int NV>
void decode_pair(const typename Elem<DT>::T* q, const void* k_cache, const void* v_cache,
                 typename Elem<DT>::T* out, const int32_t* table, int begin, int end,
                 int64_t q_row, int64_t out_row, int kvh, int group, int block_size,
                 int num_kv_heads, int64_t q_stride_t, int64_t q_stride_h, int64_t o_stride_t,
                 int64_t o_stride_h, float scale, float softcap, const float* lut, float k_scale,
                 float v_scale, const float* sinks, Stream* stream, float* state) {
    using E = Elem<DT>;
    constexpr int D = NV * 16;
    constexpr int64_t esize = FP8 ? 1 : sizeof(typename Elem<DT>::T);
    constexpr bool bf16dot = kDirectBf16<DT, FP8>;
    constexpr bool kin = kKInPlace<DT, FP8>;
    // Heads per register block of the V pass: NV accumulators each, at most 16 registers.
    constexpr int HB = NV >= 16 ? 1 : 16 / NV;
    alignas(64) float qf[kMaxGroup][D], acc[kMaxGroup][D];
    alignas(64) float kt[kin ? 1 : kTile][D];
    alignas(64) uint16_t qb[bf16dot ? kMaxGroup : 1][D];
    float m[kMaxGroup], l[kMaxGroup];
    // The softmax scale multiplies the fp32 scores on the bf16 path (q stays exact bf16),
    // and q on the others (as the generic path does).
    PROF_BEGIN();
    PROF_COUNT(7);
    const float qscale = scale * k_scale;
    for (int g = 0; g < group; ++g) {
        const auto* qp = q + q_row * q_stride_t + static_cast<int64_t>(kvh * group + g) * q_stride_h;
        if constexpr (bf16dot) {
            std::memcpy(qb[g], qp, D * sizeof(uint16_t));
        } else {
            for (int d = 0; d < D; ++d) qf[g][d] = E::load(qp, d) * qscale;
        }
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
        m[g] = sinks ? sinks[kvh * group + g] : -INFINITY;
        l[g] = sinks ? 1.f : 0.f;
    }
    const int64_t slot_bytes = static_cast<int64_t>(num_kv_heads) * D * esize;
    const int64_t block_bytes = static_cast<int64_t>(block_size) * slot_bytes;
    const char* kbase = static_cast<const char*>(k_cache) + kvh * D * esize;
    const char* vbase = static_cast<const char*>(v_cache) + kvh * D * esize;
    const int start = begin, ctx = end;
    const int num_blocks = (ctx + block_size - 1) / block_size;
    const int chunk_blocks = std::max(1, kChunkTokens / block_size);
    const int64_t stride = static_cast<int64_t>(chunk_blocks) * block_size + kTile;  // per head
    float* sbuf = score_buffer(static_cast<size_t>(group) * stride);
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
    const __m512 vqscale = _mm512_set1_ps(qscale);
    const auto tokens_of = [&](int b) { return std::min(block_size, ctx - b * block_size); };
    for (int b0 = start / block_size; b0 < num_blocks; b0 += chunk_blocks) {
        const int b1 = std::min(num_blocks, b0 + chunk_blocks);
        const int p0 = std::max(start, b0 * block_size);  // first position of the chunk
        const int len = std::min(ctx, b1 * block_size) - p0;
        PROF(b0 == start / block_size ? 0 : 3);
        // Pass 1: every score of the chunk, and a running max per head (vector-wide).
        __m512 vmax[kMaxGroup];
        for (int g = 0; g < group; ++g) vmax[g] = _mm512_set1_ps(-INFINITY);
        for (int b = b0; b < b1; ++b) {
            // The chunk's K blocks then its V blocks, as one stream asked for kAhead blocks
            // ahead (the first kAhead of the pair's K before the pair started).
            if (!stream) {
                const int i = b - b0 + kAhead, nb = b1 - b0;
                if (i < nb)
                    prefetch_rows(kbase, table[b0 + i], block_bytes, slot_bytes, tokens_of(b0 + i), D * esize);
                else if (i < 2 * nb)
                    prefetch_rows(vbase, table[b0 + i - nb], block_bytes, slot_bytes, tokens_of(b0 + i - nb), D * esize);
            }
            const char* kb = kbase + static_cast<int64_t>(table[b]) * block_bytes;
            const int n = tokens_of(b);
            for (int t0 = b == b0 ? p0 - b * block_size : 0; t0 < n; t0 += kTile) {
                const int cnt = std::min(kTile, n - t0);
                if (stream) stream->rows(cnt);
                const char* kr0 = kb + t0 * slot_bytes;
                if constexpr (!kin) {
                    for (int j = 0; j < cnt; ++j)
                        for (int c = 0; c < NV; ++c)
                            _mm512_store_ps(&kt[j][16 * c],
                                            Row<DT, FP8>::load(kr0 + j * slot_bytes + 16 * c * esize, lut));
                }
                const char* krow[kTile];
                for (int j = 0; j < kTile; ++j)
                    krow[j] = j >= cnt ? kZeros
                              : kin    ? kr0 + j * slot_bytes
                                       : reinterpret_cast<const char*>(kt[j]);
                const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1u);
                const int64_t at = b * block_size + t0 - p0;
                for (int g = 0; g < group; ++g) {
                    // No branch per token (rows past the tile read zeros): the 16 partial
                    // sums stay in registers, the loops unroll.
                    __m512 part[kTile];
                    if constexpr (bf16dot) {
                        __m512bh qv[NV / 2];
                        for (int c = 0; c < NV / 2; ++c)
                            qv[c] = load_bh(&qb[g][32 * c]);
                        for (int j = 0; j < kTile; ++j) {
                            __m512 a = _mm512_setzero_ps();
                            for (int c = 0; c < NV / 2; ++c)
                                a = _mm512_dpbf16_ps(a, load_bh(krow[j] + 64 * c), qv[c]);
                            part[j] = a;
                        }
                    } else {
                        __m512 qv[NV];
                        for (int c = 0; c < NV; ++c) qv[c] = _mm512_load_ps(&qf[g][16 * c]);
                        for (int j = 0; j < kTile; ++j) {
                            __m512 a = _mm512_setzero_ps();
                            for (int c = 0; c < NV; ++c)
                                a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(krow[j] + 64 * c), a);
                            part[j] = a;
                        }
                    }
                    __m512 s = transpose_sum(part);
                    if constexpr (bf16dot) s = _mm512_mul_ps(s, vqscale);
                    float* sg = sbuf + g * stride + at;
                    if (softcap > 0.f) {
                        alignas(64) float tmp[kTile];
                        _mm512_store_ps(tmp, s);
                        for (int j = 0; j < cnt; ++j) tmp[j] = softcap * std::tanh(tmp[j] * inv_cap);
                        s = _mm512_load_ps(tmp);
                    }
                    _mm512_mask_storeu_ps(sg, valid, s);
                    vmax[g] = _mm512_mask_max_ps(vmax[g], valid, vmax[g], s);
                }
            }
        }
        PROF(1);
        // Pass 2: the chunk's weights exp(s - max), their sums, the old state rescaled.
        float alpha[kMaxGroup];
        for (int g = 0; g < group; ++g) {
            const float top = std::max(m[g], _mm512_reduce_max_ps(vmax[g]));
            alpha[g] = std::exp(m[g] - top);  // 0 on the first chunk without sinks
            const __m512 vt = _mm512_set1_ps(top);
            float* sg = sbuf + g * stride;
            __m512 sum = _mm512_setzero_ps();
            for (int i = 0; i < len; i += 16) {
                const __mmask16 k = len - i >= 16 ? static_cast<__mmask16>(0xffff)
                                                  : static_cast<__mmask16>((1u << (len - i)) - 1u);
                const __m512 e = _mm512_maskz_mov_ps(k, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), vt)));
                _mm512_mask_storeu_ps(sg + i, k, e);
                sum = _mm512_add_ps(sum, e);
            }
            l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
            m[g] = top;
        }
        PROF(2);
        // Pass 3: the weighted values, a register block of heads at a time over the chunk.
        for (int g0 = 0; g0 < group; g0 += HB) {
            const int hb = std::min(HB, group - g0);
            __m512 av[HB][NV];
            for (int h = 0; h < HB; ++h) {
                if (h < hb) {
                    const __m512 al = _mm512_set1_ps(alpha[g0 + h]);
                    for (int c = 0; c < NV; ++c)
                        av[h][c] = _mm512_mul_ps(_mm512_load_ps(&acc[g0 + h][16 * c]), al);
                }
            }
            for (int b = b0; b < b1; ++b) {
                if (!stream && g0 == 0 && b + kAhead < b1)
                    prefetch_rows(vbase, table[b + kAhead], block_bytes, slot_bytes, tokens_of(b + kAhead), D * esize);
                const char* vb = vbase + static_cast<int64_t>(table[b]) * block_bytes;
                const int n = tokens_of(b);
                const int tb = b == b0 ? p0 - b * block_size : 0;
                const float* pw = sbuf + g0 * stride + (b * block_size - p0);
                for (int t = tb; t < n; ++t) {
                    if (stream && g0 == 0) stream->row();
                    __m512 vv[NV];
                    load_v<DT, FP8, NV>(vb + t * slot_bytes, lut, vv);
                    for (int h = 0; h < HB; ++h) {
                        if (h < hb) {
                            const __m512 pj = _mm512_set1_ps(pw[h * stride + t]);
                            for (int c = 0; c < NV; ++c) av[h][c] = _mm512_fmadd_ps(pj, vv[c], av[h][c]);
                        }
                    }
                }
            }
            for (int h = 0; h < HB; ++h)
                if (h < hb)
                    for (int c = 0; c < NV; ++c) _mm512_store_ps(&acc[g0 + h][16 * c], av[h][c]);
        }
    }
    PROF(start / block_size < num_blocks ? 3 : 0);
    for (int g = 0; g < group; ++g) {
        if (state) {
            float* st = state + g * kStateFloats<NV>;
            st[0] = m[g];
            st[1] = l[g];
            std::memcpy(st + 16, acc[g], sizeof acc[g]);
        } else {
            store_out<DT, FP8, NV>(out + out_row * o_stride_t + static_cast<int64_t>(kvh * group + g) * o_stride_h,
                                   acc[g], l[g], v_scale);
        }
    }
    PROF(4);
}

// A pair's outputs from its parts' states (in part order, so the result does not depend on
// which thread ran which part): each part's sum and accumulators rescaled to the largest
// max, a sink's logit joining as one more part with sum 1 and no value.
template <int DT, int FP8, int NV>
void merge_parts(const float* state, int parts, typename Elem<DT>::T* out, int64_t out_row,
                 int kvh, int group, int64_t o_stride_t, int64_t o_stride_h, float v_scale,
                 const float* sinks) {
    constexpr int64_t S = kStateFloats<NV>;
    const int64_t part_stride = group * S;
    for (int g = 0; g < group; ++g) {
        const float* st = state + g * S;
        float top = sinks ? sinks[kvh * group + g] : -INFINITY;
        for (int k = 0; k < parts; ++k) top = std::max(top, st[k * part_stride]);
        float l = 0.f;
        __m512 acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
        if (top > -INFINITY) {
            if (sinks) l = std::exp(sinks[kvh * group + g] - top);
            for (int k = 0; k < parts; ++k) {
                const float* pk = st + k * part_stride;
                if (pk[0] == -INFINITY) continue;  // an empty part
                const float w = std::exp(pk[0] - top);
                l += pk[1] * w;
                const __m512 vw = _mm512_set1_ps(w);
                for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(_mm512_load_ps(pk + 16 + 16 * c), vw, acc[c]);
            }
        }
        alignas(64) float a[NV * 16];
        for (int c = 0; c < NV; ++c) _mm512_store_ps(a + 16 * c, acc[c]);
        store_out<DT, FP8, NV>(out + out_row * o_stride_t + static_cast<int64_t>(kvh * group + g) * o_stride_h,
                               a, l, v_scale);
    }
}
}  // namespace fast
#endif

template <int DT, int FP8, int HEAD_DIM>
void decode_all(const void* q, const void* k_cache, const void* v_cache, void* out,
                const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                const int64_t* rows, int64_t num_seqs, int num_heads, int num_kv_heads,
                int head_dim, int block_size, int64_t q_stride_t, int64_t q_stride_h,
                int64_t o_stride_t, int64_t o_stride_h, float scale, int window, float softcap,
                int num_threads, const float* lut, const float* k_scales,
                const float* v_scales, int64_t scale_stride, const float* sinks) {
    using T = typename Elem<DT>::T;
    using KT = typename KVLoad<DT, (FP8 != 0)>::T;
    PROF_BEGIN();
    const int group = num_heads / num_kv_heads;
    const int64_t pairs = num_seqs * num_kv_heads;
#if defined(__AVX512F__)
    using StreamT = fast::Stream;
    constexpr bool kFastDim = HEAD_DIM > 0 && HEAD_DIM % 32 == 0;
#else
    using StreamT = void;
    constexpr bool kFastDim = false;
#endif
    const bool fast_path = kFastDim && group <= kMaxFastGroup;
    // Few pairs (one or a few requests) cut their contexts into parts, so both cores read
    // (flash-decoding: a partial softmax per part, merged per pair after the parallel loop).
    // The cut depends on the batch only, never on the threads: results do not either.
    int parts = 1;
    if (fast_path && pairs < kSplitItems) {
        int longest = 0;
        for (int64_t s = 0; s < num_seqs; ++s)
            longest = std::max(longest, window > 0 ? std::min<int>(seq_lens[s], window) : seq_lens[s]);
        const int64_t want = (kSplitItems + pairs - 1) / pairs;
        parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, longest / kMinPartTokens)));
    }
    const int64_t items = pairs * parts;
#if defined(__AVX512F__)
    constexpr int64_t state_floats = kFastDim ? fast::kStateFloats<HEAD_DIM / 16> : 0;
#else
    constexpr int64_t state_floats = 0;
#endif
    // The parts' states, in the calling thread's buffer (grown once, never shrunk: nothing
    // allocated per call).
    float* states = nullptr;
    if (parts > 1) {
        thread_local std::vector<float> state_buf;
        const size_t need = static_cast<size_t>(items * group * state_floats) + 16;
        if (state_buf.size() < need) state_buf.resize(need);
        states = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(state_buf.data()) + 63) & ~uintptr_t{63});
    }
    (void)states;  // read only where the fast path is built
    auto one = [&](int64_t item, StreamT* stream) {
        const int64_t p = item / parts;
#if defined(__AVX512F__)
        if constexpr (kFastDim) {
            if (!stream && p + 1 < pairs) {
                const int64_t s1 = (p + 1) / num_kv_heads;
                fast::prefetch_pair(k_cache, block_tables + s1 * table_stride, seq_lens[s1],
                                    static_cast<int>((p + 1) % num_kv_heads), block_size,
                                    num_kv_heads, HEAD_DIM * sizeof(KT), window);
            }
        }
#endif
        const int64_t seq = p / num_kv_heads;
        const int kvh = static_cast<int>(p % num_kv_heads);
        const int64_t row = rows ? rows[seq] : seq;
#if defined(__AVX512F__)
        if constexpr (kFastDim) {
            if (fast_path) {
                int begin = 0, end = 0;
                fast::part_range(seq_lens[seq], window, block_size, parts, static_cast<int>(item % parts),
                                 begin, end);
                fast::decode_pair<DT, FP8, HEAD_DIM / 16>(
                    static_cast<const T*>(q), k_cache, v_cache, static_cast<T*>(out),
                    block_tables + seq * table_stride, begin, end, row, row, kvh, group,
                    block_size, num_kv_heads, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                    scale, softcap, lut, k_scales[kvh * scale_stride],
                    v_scales[kvh * scale_stride], parts > 1 ? nullptr : sinks, stream,
                    parts > 1 ? states + item * group * state_floats : nullptr);
                return;
            }
        }
#endif
#if defined(PAGEMILL_DECODE_AVX2)
        if constexpr (FP8 == kNoBytes && (HEAD_DIM == 64 || HEAD_DIM == 128)) {
            if (group <= avx2::kMaxGroup) {
                avx2::decode_pair<DT, HEAD_DIM>(
                    static_cast<const T*>(q), static_cast<const T*>(k_cache),
                    static_cast<const T*>(v_cache), static_cast<T*>(out),
                    block_tables + seq * table_stride, seq_lens[seq], row, row, kvh, group,
                    block_size, num_kv_heads, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                    scale, window, softcap, k_scales[kvh * scale_stride],
                    v_scales[kvh * scale_stride], sinks);
                return;
            }
        }
#endif
        decode_pair<DT, FP8, HEAD_DIM>(static_cast<const T*>(q), static_cast<const KT*>(k_cache),
                                  static_cast<const KT*>(v_cache), static_cast<T*>(out),
                                  block_tables + seq * table_stride, seq_lens[seq], row, row,
                                  kvh, group, head_dim, block_size, num_kv_heads, q_stride_t,
                                  q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, lut,
                                  k_scales[kvh * scale_stride], v_scales[kvh * scale_stride], sinks);
    };
    // A run of items in order, with the stream of rows they will read asked for ahead.
    auto run = [&](int64_t lo, int64_t hi) {
#if defined(__AVX512F__)
        if constexpr (kFastDim) {
            if (fast_path) {
                const int64_t row_bytes = static_cast<int64_t>(HEAD_DIM) * sizeof(KT);
                fast::Stream st{static_cast<const char*>(k_cache), static_cast<const char*>(v_cache),
                                block_tables, table_stride, seq_lens, num_kv_heads, block_size, window,
                                row_bytes, num_kv_heads * row_bytes, block_size * num_kv_heads * row_bytes};
                st.parts = parts;
                st.end = hi;
                st.open(lo);
                st.rows(fast::kLead);
                for (int64_t i = lo; i < hi; ++i) one(i, &st);
                return;
            }
        }
#endif
        for (int64_t i = lo; i < hi; ++i) one(i, nullptr);
    };
    // Items are request-major, so neighbouring items read the same blocks. Runs of about
    // an eighth of a thread's share balance uneven contexts at little scheduling cost; one
    // thread (or one item) runs without entering a parallel region at all.
    const int threads = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), items));
    if (threads <= 1) {
        run(0, items);
    } else {
        const int64_t grain = std::max<int64_t>(1, items / (8 * threads));
        const int64_t runs = (items + grain - 1) / grain;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t r = 0; r < runs; ++r) run(r * grain, std::min(items, (r + 1) * grain));
    }
#if defined(PAGEMILL_DECODE_PROFILE)
    const uint64_t prof_loop = __rdtsc();
#endif
#if defined(__AVX512F__)
    if constexpr (kFastDim) {
        if (parts > 1) {
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t seq = p / num_kv_heads;
                const int kvh = static_cast<int>(p % num_kv_heads);
                fast::merge_parts<DT, FP8, HEAD_DIM / 16>(states + p * parts * group * state_floats, parts,
                                                         static_cast<T*>(out), rows ? rows[seq] : seq, kvh,
                                                         group, o_stride_t, o_stride_h,
                                                         v_scales[kvh * scale_stride], sinks);
            }
        }
    }
#endif
#if defined(PAGEMILL_DECODE_PROFILE)
    const uint64_t prof_end = __rdtsc();
    g_prof[5] += double(prof_end - prof_loop);
    g_prof[6] += double(prof_end - prof_t);
#endif
}

template <int DT, int FP8>
int dispatch_dim(const void* q, const void* k, const void* v, void* out, const int32_t* bt,
                 int64_t bts, const int32_t* lens, const int64_t* rows, int64_t n, int h,
                 int kvh, int d, int bs, int64_t qst, int64_t qsh, int64_t ost, int64_t osh,
                 float scale, int win, float cap, int nt, const float* lut, const float* ks, const float* vs, int64_t sst,
                 const float* sk) {
    switch (d) {
        case 64: decode_all<DT, FP8, 64>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk); break;
        case 128: decode_all<DT, FP8, 128>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk); break;
        default:
            if (d > kMaxBlock) return 2;
            // Other head dims take the portable path, which reads any byte format through
            // the table: one instantiation for all of them.
            decode_all<DT, (FP8 > kTableBytes ? kTableBytes : FP8), 0>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
    }
    return 0;
}

template <int DT>
int dispatch_format(int kf, const void* q, const void* k, const void* v, void* out, const int32_t* bt,
                    int64_t bts, const int32_t* lens, const int64_t* rows, int64_t n, int h, int kvh,
                    int d, int bs, int64_t qst, int64_t qsh, int64_t ost, int64_t osh, float scale,
                    int win, float cap, int nt, const float* lut, const float* ks, const float* vs,
                    int64_t sst, const float* sk) {
    // By their bits under a bf16 query only (the CPU's compute dtype): each format is one
    // more build of the kernel, so fp32 and fp16 queries read 8-bit caches through the table.
    if (DT != 1 && kf > kTableBytes) kf = kTableBytes;
    switch (kf) {
        case kNoBytes: return dispatch_dim<DT, kNoBytes>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
        case kE4M3: return dispatch_dim<DT, DT == 1 ? kE4M3 : kTableBytes>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
        case kE5M2: return dispatch_dim<DT, DT == 1 ? kE5M2 : kTableBytes>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
        case kInt8: return dispatch_dim<DT, DT == 1 ? kInt8 : kTableBytes>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
        default: return dispatch_dim<DT, kTableBytes>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
    }
}

}  // namespace

// kv_lut: null for a cache in q's dtype; else the 256 values of the cache's byte format,
// and kv_format says which format it is (kE4M3, kE5M2, kInt8: the AVX-512 path converts
// the bytes by their bits under a bf16 query; anything else: through kv_lut). The portable path always reads
// bytes through kv_lut. kv_format is the last argument, so a caller of the kernel from
// before it (which passes a table and nothing more) reaches the table path unchanged.
extern "C" int pagemill_paged_decode(int dtype, const void* q, const void* k_cache,
                                     const void* v_cache, void* out,
                                     const int32_t* block_tables, int64_t table_stride,
                                     const int32_t* seq_lens, const int64_t* rows,
                                     int64_t num_seqs, int num_heads, int num_kv_heads,
                                     int head_dim, int block_size, int64_t q_stride_t,
                                     int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                                     float scale, int window, float softcap,
                                     int num_threads, const float* kv_lut, const float* k_scale,
                                     const float* v_scale, int64_t scale_stride,
                                     const float* sinks, int kv_format) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size > kMaxBlock) return 1;
    const int kf = !kv_lut ? kNoBytes
                   : (kv_format == kE4M3 || kv_format == kE5M2 || kv_format == kInt8) ? kv_format
                                                                                      : kTableBytes;
    switch (dtype) {
        case 0: return dispatch_format<0>(kf, q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        case 1: return dispatch_format<1>(kf, q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        case 2: return dispatch_format<2>(kf, q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        default: return 3;
    }
}

#if defined(__AVX512F__)
// The slots a write stores to lie anywhere in the pool, so each row's lines miss the caches
// and an ordinary store first reads its line from memory. A row of whole 64-byte lines is
// written with streaming stores instead (no read; the next step's attention reads the row
// from memory once, the only reader it has soon).
inline void stream_row(char* dst, const char* src, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + o), _mm512_loadu_si512(src + o));
}
#endif

// The KV write (vLLM's reshape_and_cache) for a cache in the compute dtype: token i's K and
// V rows (num_kv_heads * head_dim elements, contiguous; `row_bytes` in all) go to slot
// slots[i] of the caches; a slot of -1 is skipped. One call for K and V, and no host-side
// checks that need the slots read back: a slot outside the cache refuses the whole write
// (status 1) before anything is copied.
extern "C" int pagemill_reshape_and_cache(const void* k, const void* v, void* k_cache,
                                          void* v_cache, const int64_t* slots,
                                          int64_t num_tokens, int64_t k_stride,
                                          int64_t v_stride, int64_t row_bytes,
                                          int64_t num_slots) {
    for (int64_t i = 0; i < num_tokens; ++i)
        if (slots[i] < -1 || slots[i] >= num_slots) return 1;
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    char* kc = static_cast<char*>(k_cache);
    char* vc = static_cast<char*>(v_cache);
#if defined(__AVX512F__)
    if (row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(kc) % 64 == 0 &&
        reinterpret_cast<uintptr_t>(vc) % 64 == 0) {
        for (int64_t i = 0; i < num_tokens; ++i) {
            const int64_t s = slots[i];
            if (s < 0) continue;
            stream_row(kc + s * row_bytes, ks + i * k_stride, row_bytes);
            stream_row(vc + s * row_bytes, vs + i * v_stride, row_bytes);
        }
        _mm_sfence();
        return 0;
    }
#endif
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        std::memcpy(kc + s * row_bytes, ks + i * k_stride, static_cast<size_t>(row_bytes));
        std::memcpy(vc + s * row_bytes, vs + i * v_stride, static_cast<size_t>(row_bytes));
    }
    return 0;
}

// ---- the KV write into an 8-bit cache ---------------------------------------------------------
// kv_quant.quantize's contract, byte for byte: y = x / scale in fp32 (a true division, as
// torch divides), saturated to the format's largest finite value (NaN passes), then the
// format's code rounded to nearest, ties to even: fp8 by its bits (the mantissa rounded at
// its last kept bit; below the smallest normal, y scaled to units of the smallest
// subnormal and rounded as an integer), int8 by rounding y to an integer.
namespace {

inline uint32_t f32_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

// |y| (finite, at most the format's max, or NaN) as the code's 7 low bits.
template <int KF>
inline uint8_t fp8_code(float a) {
    constexpr int MANT = KF == kE4M3 ? 3 : 2;          // mantissa bits kept
    constexpr int BIAS = KF == kE4M3 ? 7 : 15;
    constexpr int SHIFT = 23 - MANT;
    const uint32_t b = f32_bits(a);
    if (b > 0x7f800000u) return 0x7f;                 // NaN
    if (b < static_cast<uint32_t>(127 - BIAS + 1) << 23)  // below the smallest normal
        return static_cast<uint8_t>(std::nearbyint(a * std::ldexp(1.f, BIAS - 1 + MANT)));
    const uint32_t r = b + ((1u << (SHIFT - 1)) - 1u) + ((b >> SHIFT) & 1u);
    return static_cast<uint8_t>((r >> SHIFT) - (static_cast<uint32_t>(127 - BIAS) << MANT));
}

template <int KF>
inline uint8_t quant_one(float y) {
    if constexpr (KF == kInt8) {
        if (y != y) return 0;
        return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, y)))));
    } else {
        constexpr float LIM = KF == kE4M3 ? 448.f : 57344.f;
        const float c = y != y ? y : std::min(LIM, std::max(-LIM, y));
        return static_cast<uint8_t>(fp8_code<KF>(std::fabs(c)) | (std::signbit(c) ? 0x80 : 0));
    }
}

#if defined(__AVX512F__)
// 16 values at a time, the same arithmetic in lanes.
template <int KF>
inline __m128i quant16(__m512 y) {
    const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    if constexpr (KF == kInt8) {
        const __m512 c = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f), y));
        const __m512i i = _mm512_maskz_cvt_roundps_epi32(static_cast<__mmask16>(~nan), c,
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm512_cvtepi32_epi8(i);
    } else {
        constexpr int MANT = KF == kE4M3 ? 3 : 2;
        constexpr int BIAS = KF == kE4M3 ? 7 : 15;
        constexpr int SHIFT = 23 - MANT;
        constexpr float LIM = KF == kE4M3 ? 448.f : 57344.f;
        // min/max return their second operand for NaN: NaN lanes pass through.
        const __m512 c = _mm512_max_ps(_mm512_set1_ps(-LIM), _mm512_min_ps(_mm512_set1_ps(LIM), y));
        const __m512i bits = _mm512_castps_si512(c);
        const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u))), 24);
        const __m512i b = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, SHIFT), _mm512_set1_epi32(1));
        const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32((1 << (SHIFT - 1)) - 1)));
        __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(r, SHIFT), _mm512_set1_epi32((127 - BIAS) << MANT));
        const __mmask16 sub = _mm512_cmplt_epu32_mask(b, _mm512_set1_epi32((127 - BIAS + 1) << 23));
        const __m512 units = _mm512_mul_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(std::ldexp(1.f, BIAS - 1 + MANT)));
        code = _mm512_mask_mov_epi32(code, sub, _mm512_cvt_roundps_epi32(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7f));
        return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
    }
}
#endif

template <int DT>
inline float load_elem(const void* p, int64_t i) {
    return Elem<DT>::load(static_cast<const typename Elem<DT>::T*>(p), i);
}

// One token's rows (heads x dim, row i of x at x_stride elements) as codes at dst.
template <int DT, int KF>
void quant_rows(const void* x, int64_t row, int64_t x_stride, int heads, int dim,
                const float* scales, int64_t scale_stride, uint8_t* dst) {
    for (int h = 0; h < heads; ++h) {
        const float s = scales ? scales[h * scale_stride] : 1.f;
        const int64_t base = row * x_stride + static_cast<int64_t>(h) * dim;
        uint8_t* d = dst + static_cast<int64_t>(h) * dim;
        int i = 0;
#if defined(__AVX512F__)
        const __m512 vs = _mm512_set1_ps(s);
        for (; i + 16 <= dim; i += 16) {
            __m512 v;
            if constexpr (DT == 0) {
                v = _mm512_loadu_ps(static_cast<const float*>(x) + base + i);
            } else if constexpr (DT == 1) {
                const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + base + i)));
                v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            } else {
                v = _mm512_cvtph_ps(_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + base + i)));
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), quant16<KF>(_mm512_div_ps(v, vs)));
        }
#endif
        for (; i < dim; ++i) d[i] = quant_one<KF>(load_elem<DT>(x, base + i) / s);
    }
}

template <int DT, int KF>
void quant_write(const void* k, const void* v, uint8_t* kc, uint8_t* vc, const int64_t* slots,
                 int64_t num_tokens, int64_t k_stride, int64_t v_stride, int heads, int dim,
                 const float* k_scale, const float* v_scale, int64_t scale_stride) {
    const int64_t row_bytes = static_cast<int64_t>(heads) * dim;
    for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        quant_rows<DT, KF>(k, i, k_stride, heads, dim, k_scale, scale_stride, kc + s * row_bytes);
        quant_rows<DT, KF>(v, i, v_stride, heads, dim, v_scale, scale_stride, vc + s * row_bytes);
    }
}

template <int DT>
int quant_write_format(int kv_format, const void* k, const void* v, uint8_t* kc, uint8_t* vc,
                       const int64_t* slots, int64_t n, int64_t ks, int64_t vs, int heads, int dim,
                       const float* k_scale, const float* v_scale, int64_t scale_stride) {
    switch (kv_format) {
        case kE4M3: quant_write<DT, kE4M3>(k, v, kc, vc, slots, n, ks, vs, heads, dim, k_scale, v_scale, scale_stride); return 0;
        case kE5M2: quant_write<DT, kE5M2>(k, v, kc, vc, slots, n, ks, vs, heads, dim, k_scale, v_scale, scale_stride); return 0;
        case kInt8: quant_write<DT, kInt8>(k, v, kc, vc, slots, n, ks, vs, heads, dim, k_scale, v_scale, scale_stride); return 0;
        default: return 3;
    }
}

}  // namespace

// The KV write into an 8-bit cache (kv_format kE4M3, kE5M2 or kInt8): token i's K and V
// (dtype 0 fp32, 1 bf16, 2 fp16; `heads` rows of `dim` elements, contiguous, the token's
// rows k_stride / v_stride elements apart) quantized with the layer's scales (null: 1;
// scale_stride 0: one per layer, 1: one per KV head) into slot slots[i], -1 skipped. A slot
// outside the cache refuses the whole write (status 1) before anything is written; an
// unknown dtype or format is status 2 or 3.
extern "C" int pagemill_reshape_and_cache_quant(int dtype, int kv_format, const void* k,
                                                const void* v, void* k_cache, void* v_cache,
                                                const int64_t* slots, int64_t num_tokens,
                                                int64_t k_stride, int64_t v_stride, int heads,
                                                int dim, const float* k_scale,
                                                const float* v_scale, int64_t scale_stride,
                                                int64_t num_slots) {
    for (int64_t i = 0; i < num_tokens; ++i)
        if (slots[i] < -1 || slots[i] >= num_slots) return 1;
    auto* kc = static_cast<uint8_t*>(k_cache);
    auto* vc = static_cast<uint8_t*>(v_cache);
    switch (dtype) {
        case 0: return quant_write_format<0>(kv_format, k, v, kc, vc, slots, num_tokens, k_stride, v_stride, heads, dim, k_scale, v_scale, scale_stride);
        case 1: return quant_write_format<1>(kv_format, k, v, kc, vc, slots, num_tokens, k_stride, v_stride, heads, dim, k_scale, v_scale, scale_stride);
        case 2: return quant_write_format<2>(kv_format, k, v, kc, vc, slots, num_tokens, k_stride, v_stride, heads, dim, k_scale, v_scale, scale_stride);
        default: return 2;
    }
}

#if defined(PAGEMILL_DECODE_PROFILE)
// The calling thread's phase counters (see PROF), copied to out[8] and optionally zeroed.
extern "C" void pagemill_paged_decode_profile(double* out, int reset) {
    for (int i = 0; i < 8; ++i) {
        out[i] = g_prof[i];
        if (reset) g_prof[i] = 0.0;
    }
}
#endif
