// Paged decode attention on CPU: one query token per request, K/V read in place from the
// paged cache through the block table (no gathered copy), online softmax in fp32.
//
// Built at run time by pagemill.kernels.cpu_native with the host's compiler (-O3
// -march=native -fopenmp) and called through ctypes with raw pointers, so it needs no
// torch headers (seconds to compile, not a minute). Work is split over (request, KV head)
// pairs; each pair reads its K/V once for all the query heads that share the KV head
// (GQA), one block (or, on the AVX-512 path, one tile of up to 16 tokens) at a time: scores
// for the block, then a rescale of the running max and sum, then the weighted V rows. A sliding window (window > 0: the last `window`
// positions) starts the walk at the window's first block and skips the positions before
// it; a soft-cap (softcap > 0) maps each scaled score s to softcap * tanh(s / softcap).
// An fp8 cache (kv_lut non-null) is read as bytes through a 256-entry table of the format's
// values; its scales fold into the query (k_scale) and the output (v_scale) of each
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

#if defined(__AVX512F__)
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

// K/V element access: the compute dtype's own, or fp8 bytes decoded through a table.
template <int DT, bool FP8> struct KVLoad;
template <int DT> struct KVLoad<DT, false> {
    using T = typename Elem<DT>::T;
    static inline float load(const T* p, int64_t i, const float*) { return Elem<DT>::load(p, i); }
};
template <int DT> struct KVLoad<DT, true> {
    using T = uint8_t;
    static inline float load(const T* p, int64_t i, const float* lut) { return lut[p[i]]; }
};

constexpr int kMaxBlock = 256;    // largest block_size and head_dim served here

template <int DT, bool FP8, int HEAD_DIM>
void decode_pair(const typename Elem<DT>::T* q, const typename KVLoad<DT, FP8>::T* k_cache,
                 const typename KVLoad<DT, FP8>::T* v_cache, typename Elem<DT>::T* out,
                 const int32_t* table, int32_t ctx, int64_t q_row, int64_t out_row,
                 int kvh, int group, int head_dim, int block_size, int num_kv_heads,
                 int64_t q_stride_t, int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                 float scale, int window, float softcap, const float* lut, float k_scale,
                 float v_scale, const float* sinks) {
    using E = Elem<DT>;
    using KV = KVLoad<DT, FP8>;
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
            for (int t = t0; t < n; ++t) {
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
// The AVX-512 path, for head dims that are a multiple of 16 (64 and 128 are instantiated).
// Per (request, KV head) pair it walks the context in tiles of up to 16 tokens: the tile's
// K and V rows are widened to fp32 once into a per-thread scratch (so bf16/fp16/fp8 cost
// one conversion however many query heads share them), then each query head of the group
// takes its 16 scores with one FMA chain per token and a single transpose-and-add of the
// 16 partial vectors (no horizontal sum per token), a vectorised exp, and NV accumulator
// registers for the weighted V rows. Nothing is allocated per call.
namespace fast {

template <int DT, bool FP8> struct Row;
template <> struct Row<0, false> {
    static inline __m512 load(const void* p, const float*) { return _mm512_loadu_ps(p); }
};
template <> struct Row<1, false> {
    static inline __m512 load(const void* p, const float*) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
};
template <> struct Row<2, false> {
    static inline __m512 load(const void* p, const float*) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    }
};
template <int DT> struct Row<DT, true> {
    static inline __m512 load(const void* p, const float* lut) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
        return _mm512_i32gather_ps(idx, lut, 4);
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

constexpr int kTile = 16;
constexpr int kMaxGroup = 16;  // larger GQA groups take the generic path

template <int DT, bool FP8, int NV>
void decode_pair(const typename Elem<DT>::T* q, const void* k_cache, const void* v_cache,
                 typename Elem<DT>::T* out, const int32_t* table, int32_t ctx, int64_t q_row,
                 int64_t out_row, int kvh, int group, int block_size, int num_kv_heads,
                 int64_t q_stride_t, int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                 float scale, int window, float softcap, const float* lut, float k_scale,
                 float v_scale, const float* sinks) {
    using E = Elem<DT>;
    constexpr int D = NV * 16;
    constexpr int64_t esize = FP8 ? 1 : sizeof(typename Elem<DT>::T);
    // On the stack (at most 32 KB): a thread_local scratch costs a TLS lookup per use here.
    alignas(64) float qf[kMaxGroup][D], acc[kMaxGroup][D];
    alignas(64) float kt[kTile][D], vt[kTile][D];
    float m[kMaxGroup], l[kMaxGroup];
    alignas(64) float p[kTile];
    for (int g = 0; g < group; ++g) {
        const auto* qp = q + q_row * q_stride_t + static_cast<int64_t>(kvh * group + g) * q_stride_h;
        for (int d = 0; d < D; ++d) qf[g][d] = E::load(qp, d) * scale * k_scale;
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
        m[g] = sinks ? sinks[kvh * group + g] : -INFINITY;
        l[g] = sinks ? 1.f : 0.f;
    }
    const int64_t slot_bytes = static_cast<int64_t>(num_kv_heads) * D * esize;
    const int64_t block_bytes = static_cast<int64_t>(block_size) * slot_bytes;
    const char* kbase = static_cast<const char*>(k_cache) + kvh * D * esize;
    const char* vbase = static_cast<const char*>(v_cache) + kvh * D * esize;
    const int num_blocks = (ctx + block_size - 1) / block_size;
    const int start = (window > 0 && ctx > window) ? ctx - window : 0;
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
    for (int b = start / block_size; b < num_blocks; ++b) {
        const int n = (b == num_blocks - 1) ? ctx - b * block_size : block_size;
        const char* kb = kbase + static_cast<int64_t>(table[b]) * block_bytes;
        const char* vb = vbase + static_cast<int64_t>(table[b]) * block_bytes;
        if (b + 1 < num_blocks) {
            // The next block is elsewhere in memory (the table's order, not the address
            // order): ask for its rows now so they arrive while this block computes.
            const int64_t nb = static_cast<int64_t>(table[b + 1]) * block_bytes;
            const int nt = std::min(block_size, ctx - (b + 1) * block_size);
            for (int t = 0; t < nt; ++t)
                for (int64_t o = 0; o < D * esize; o += 64) {
                    _mm_prefetch(kbase + nb + t * slot_bytes + o, _MM_HINT_T0);
                    _mm_prefetch(vbase + nb + t * slot_bytes + o, _MM_HINT_T0);
                }
        }
        for (int t0 = (b == start / block_size) ? start - b * block_size : 0; t0 < n; t0 += kTile) {
            const int cnt = std::min(kTile, n - t0);
            for (int j = 0; j < cnt; ++j) {
                const char* kr = kb + (t0 + j) * slot_bytes;
                const char* vr = vb + (t0 + j) * slot_bytes;
                for (int c = 0; c < NV; ++c) {
                    _mm512_store_ps(&kt[j][16 * c], Row<DT, FP8>::load(kr + 16 * c * esize, lut));
                    _mm512_store_ps(&vt[j][16 * c], Row<DT, FP8>::load(vr + 16 * c * esize, lut));
                }
            }
            const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1u);
            for (int g = 0; g < group; ++g) {
                __m512 qv[NV], part[kTile];
                for (int c = 0; c < NV; ++c) qv[c] = _mm512_load_ps(&qf[g][16 * c]);
                for (int j = 0; j < kTile; ++j) {
                    __m512 a = _mm512_setzero_ps();
                    if (j < cnt)
                        for (int c = 0; c < NV; ++c)
                            a = _mm512_fmadd_ps(qv[c], _mm512_load_ps(&kt[j][16 * c]), a);
                    part[j] = a;
                }
                __m512 s = transpose_sum(part);
                if (softcap > 0.f) {
                    _mm512_store_ps(p, s);
                    for (int j = 0; j < cnt; ++j) p[j] = softcap * std::tanh(p[j] * inv_cap);
                    s = _mm512_load_ps(p);
                }
                s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
                const float top = std::max(m[g], _mm512_reduce_max_ps(s));
                const float alpha = std::exp(m[g] - top);
                const __m512 e = _mm512_maskz_mov_ps(valid, exp_neg(_mm512_sub_ps(s, _mm512_set1_ps(top))));
                l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
                m[g] = top;
                _mm512_store_ps(p, e);
                __m512 av[NV];
                const __m512 al = _mm512_set1_ps(alpha);
                for (int c = 0; c < NV; ++c) av[c] = _mm512_mul_ps(_mm512_load_ps(&acc[g][16 * c]), al);
                for (int j = 0; j < cnt; ++j) {
                    const __m512 pj = _mm512_set1_ps(p[j]);
                    for (int c = 0; c < NV; ++c)
                        av[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(&vt[j][16 * c]), av[c]);
                }
                for (int c = 0; c < NV; ++c) _mm512_store_ps(&acc[g][16 * c], av[c]);
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        auto* op = out + out_row * o_stride_t + static_cast<int64_t>(kvh * group + g) * o_stride_h;
        const float inv = l[g] > 0.f ? v_scale / l[g] : 0.f;
        for (int d = 0; d < D; ++d) E::store(op, d, acc[g][d] * inv);
    }
}

}  // namespace fast
#endif

template <int DT, bool FP8, int HEAD_DIM>
void decode_all(const void* q, const void* k_cache, const void* v_cache, void* out,
                const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                const int64_t* rows, int64_t num_seqs, int num_heads, int num_kv_heads,
                int head_dim, int block_size, int64_t q_stride_t, int64_t q_stride_h,
                int64_t o_stride_t, int64_t o_stride_h, float scale, int window, float softcap,
                int num_threads, const float* lut, const float* k_scales,
                const float* v_scales, int64_t scale_stride, const float* sinks) {
    using T = typename Elem<DT>::T;
    using KT = typename KVLoad<DT, FP8>::T;
    const int group = num_heads / num_kv_heads;
    const int64_t pairs = num_seqs * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t seq = p / num_kv_heads;
        const int kvh = static_cast<int>(p % num_kv_heads);
        const int64_t row = rows ? rows[seq] : seq;
#if defined(__AVX512F__)
        if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
            if (group <= fast::kMaxGroup) {
                fast::decode_pair<DT, FP8, HEAD_DIM / 16>(
                    static_cast<const T*>(q), k_cache, v_cache, static_cast<T*>(out),
                    block_tables + seq * table_stride, seq_lens[seq], row, row, kvh, group,
                    block_size, num_kv_heads, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                    scale, window, softcap, lut, k_scales[kvh * scale_stride],
                    v_scales[kvh * scale_stride], sinks);
                continue;
            }
        }
#endif
        decode_pair<DT, FP8, HEAD_DIM>(static_cast<const T*>(q), static_cast<const KT*>(k_cache),
                                  static_cast<const KT*>(v_cache), static_cast<T*>(out),
                                  block_tables + seq * table_stride, seq_lens[seq], row, row,
                                  kvh, group, head_dim, block_size, num_kv_heads, q_stride_t,
                                  q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, lut,
                                  k_scales[kvh * scale_stride], v_scales[kvh * scale_stride], sinks);
    }
}

template <int DT, bool FP8>
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
            decode_all<DT, FP8, 0>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sst, sk);
    }
    return 0;
}

}  // namespace

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
                                     const float* sinks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size > kMaxBlock) return 1;
    switch (dtype) {
        case 0: return kv_lut ? dispatch_dim<0, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks)
                        : dispatch_dim<0, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        case 1: return kv_lut ? dispatch_dim<1, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks)
                        : dispatch_dim<1, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        case 2: return kv_lut ? dispatch_dim<2, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks)
                        : dispatch_dim<2, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, scale_stride, sinks);
        default: return 3;
    }
}
