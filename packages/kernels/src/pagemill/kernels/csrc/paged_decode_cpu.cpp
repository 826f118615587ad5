// Paged decode attention on CPU: one query token per request, K/V read in place from the
// paged cache through the block table (no gathered copy), online softmax in fp32.
//
// Built at run time by pagemill.kernels.cpu_native with the host's compiler (-O3
// -march=native -fopenmp) and called through ctypes with raw pointers, so it needs no
// torch headers (a second to compile, not a minute). Work is split over (request, KV head)
// pairs; each pair reads its K/V once for all the query heads that share the KV head
// (GQA), one 16-token block at a time: scores for the block, then a rescale of the running
// max and sum, then the weighted V rows. A sliding window (window > 0: the last `window`
// positions) starts the walk at the window's first block and skips the positions before
// it; a soft-cap (softcap > 0) maps each scaled score s to softcap * tanh(s / softcap).
// An fp8 cache (kv_lut non-null) is read as bytes through a 256-entry table of the format's
// values; its per-tensor scales fold into the query (k_scale) and the output (v_scale).
// Attention sinks (sinks non-null: one fp32 logit per query head, gpt-oss) start each
// head's online softmax as if the sink were a first key with a zero value: max = sink,
// sum = 1, so the sink is in the denominator and nowhere else.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <int DT, bool FP8, int HEAD_DIM>
void decode_all(const void* q, const void* k_cache, const void* v_cache, void* out,
                const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                const int64_t* rows, int64_t num_seqs, int num_heads, int num_kv_heads,
                int head_dim, int block_size, int64_t q_stride_t, int64_t q_stride_h,
                int64_t o_stride_t, int64_t o_stride_h, float scale, int window, float softcap,
                int num_threads, const float* lut, float k_scale, float v_scale,
                const float* sinks) {
    using T = typename Elem<DT>::T;
    using KT = typename KVLoad<DT, FP8>::T;
    const int group = num_heads / num_kv_heads;
    const int64_t pairs = num_seqs * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t seq = p / num_kv_heads;
        const int kvh = static_cast<int>(p % num_kv_heads);
        const int64_t row = rows ? rows[seq] : seq;
        decode_pair<DT, FP8, HEAD_DIM>(static_cast<const T*>(q), static_cast<const KT*>(k_cache),
                                  static_cast<const KT*>(v_cache), static_cast<T*>(out),
                                  block_tables + seq * table_stride, seq_lens[seq], row, row,
                                  kvh, group, head_dim, block_size, num_kv_heads, q_stride_t,
                                  q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, lut,
                                  k_scale, v_scale, sinks);
    }
}

template <int DT, bool FP8>
int dispatch_dim(const void* q, const void* k, const void* v, void* out, const int32_t* bt,
                 int64_t bts, const int32_t* lens, const int64_t* rows, int64_t n, int h,
                 int kvh, int d, int bs, int64_t qst, int64_t qsh, int64_t ost, int64_t osh,
                 float scale, int win, float cap, int nt, const float* lut, float ks, float vs,
                 const float* sk) {
    switch (d) {
        case 64: decode_all<DT, FP8, 64>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sk); break;
        case 128: decode_all<DT, FP8, 128>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sk); break;
        default:
            if (d > kMaxBlock) return 2;
            decode_all<DT, FP8, 0>(q, k, v, out, bt, bts, lens, rows, n, h, kvh, d, bs, qst, qsh, ost, osh, scale, win, cap, nt, lut, ks, vs, sk);
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
                                     int num_threads, const float* kv_lut, float k_scale,
                                     float v_scale, const float* sinks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size > kMaxBlock) return 1;
    switch (dtype) {
        case 0: return kv_lut ? dispatch_dim<0, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks)
                        : dispatch_dim<0, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks);
        case 1: return kv_lut ? dispatch_dim<1, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks)
                        : dispatch_dim<1, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks);
        case 2: return kv_lut ? dispatch_dim<2, true>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks)
                        : dispatch_dim<2, false>(q, k_cache, v_cache, out, block_tables, table_stride, seq_lens, rows, num_seqs, num_heads, num_kv_heads, head_dim, block_size, q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap, num_threads, kv_lut, k_scale, v_scale, sinks);
        default: return 3;
    }
}
