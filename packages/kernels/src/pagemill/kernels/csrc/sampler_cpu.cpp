// Whole-row passes of the sampler on CPU: argmax, and the block sums and inverse-CDF pick
// that random rows are drawn by (see pagemill.runtime.sample.row_kernels for what they
// mean). Built at run time by pagemill.kernels.sampler_cpu with the host's compiler, like
// paged_decode_cpu.cpp, and called through ctypes with raw pointers.
//
// Why native: the torch versions are several passes over [rows, vocab] that each write an
// fp32 temporary (convert, divide, subtract, exp, compare, mask, sum), and torch's argmax
// is scalar. Here each row is read in its own dtype and reduced while it is in cache.
//
// Exactness the Python side relies on: z = float(x) / t is one IEEE division (no
// -ffast-math), so a threshold z computed by torch compares equal here; a row's peak is the
// largest z; the weights of a block are recomputed by `pick` with the same exp as
// `block_sums` summed them. Rows are independent: a row's results never depend on the
// other rows of the call, nor on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

// AVX2 builds without AVX-512 weigh the columns with explicit vectors (see weight_exp8);
// AVX-512 builds keep the compiler's vectorisation of the scalar loops, which there uses
// 512-bit divisions (the explicit path is unmeasured on those machines).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PAGEMILL_SAMPLER_AVX2 1
#endif

namespace {

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

struct F32 {
    static inline float load(const void* p, int64_t i) {
        return static_cast<const float*>(p)[i];
    }
};

struct BF16 {
    static inline float load(const void* p, int64_t i) {
        return bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
    }
};

// exp(x) for the weights exp(z - peak) <= 1: Cody-Waite reduction and a degree-6
// polynomial (Cephes' expf, ~1 ulp), written so that the compiler vectorises it. Below
// -87 (and for -inf, the masked tokens) it is exactly 0.
inline float weight_exp(float x) {
    float xc = x > -87.0f ? x : -87.0f;
    xc = xc < 88.0f ? xc : 88.0f;
    const float t = xc * 1.44269504088896341f;
    const float fn = (t + 12582912.0f) - 12582912.0f;  // round to nearest integer
    float r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t n = static_cast<int32_t>(fn);
    const float scale = bits_to_float(static_cast<uint32_t>(n + 127) << 23);
    const float y = p * scale;
    return x > -87.0f ? y : 0.0f;
}

#if defined(PAGEMILL_SAMPLER_AVX2)
// weight_exp on 8 lanes, step for step (each multiply-add one FMA). The compiler's own
// vectorisation of the scalar loops took a scalar path here for the whole row (a division,
// an exp and a branch per column); explicit vectors are several times faster, and `pick`
// recomputes its block through the same function, so both see the same weights.
inline __m256 weight_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    // max/min return their second operand for a NaN lane: -87, as the scalar form does.
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f));
    const __m256 big = _mm256_set1_ps(12582912.0f);
    const __m256 fn = _mm256_sub_ps(_mm256_add_ps(t, big), big);
    __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_cvttps_epi32(fn);
    const __m256 scale =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GT_OQ), _mm256_mul_ps(p, scale));
}

template <typename L>
inline __m256 load8(const void* row, int64_t i);
template <>
inline __m256 load8<F32>(const void* row, int64_t i) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
}
template <>
inline __m256 load8<BF16>(const void* row, int64_t i) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The candidates' weights of columns [i, i + 8) (0 past c1 and for the non-candidates):
// z = x / t (one IEEE division per lane), exp(z - peak), and with a threshold only z > tz
// or z == tz at a smaller id.
template <typename L, bool kThreshold>
inline __m256 weights8(const void* row, int64_t i, int64_t c1, float t, float peak, float tz,
                       int64_t ti) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 x;
    const int64_t left = c1 - i;
    if (left >= 8) {
        x = load8<L>(row, i);
    } else {
        alignas(32) float buf[8];
        for (int j = 0; j < 8; ++j) buf[j] = j < left ? L::load(row, i + j) : 0.0f;
        x = _mm256_load_ps(buf);
    }
    const __m256 z = _mm256_div_ps(x, _mm256_set1_ps(t));
    __m256 w = weight_exp8(_mm256_sub_ps(z, _mm256_set1_ps(peak)));
    if (left < 8) {
        const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), lane);
        w = _mm256_and_ps(w, _mm256_castsi256_ps(in));
    }
    if constexpr (kThreshold) {
        const __m256 tzv = _mm256_set1_ps(tz);
        const __m256i id = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)), lane);
        const __m256 before = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(ti)), id));
        const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(z, tzv, _CMP_GT_OQ),
                                         _mm256_and_ps(_mm256_cmp_ps(z, tzv, _CMP_EQ_OQ), before));
        w = _mm256_and_ps(w, keep);
    }
    return w;
}
#endif

constexpr int64_t kChunk = 64;

// The first column in [0, vocab) that `match` accepts, else -1: chunks are tested with a
// vectorised any, then the matching chunk is scanned.
template <typename L, typename Match>
int64_t first_match(const void* row, int64_t vocab, Match match) {
    for (int64_t i0 = 0; i0 < vocab; i0 += kChunk) {
        const int64_t i1 = i0 + kChunk < vocab ? i0 + kChunk : vocab;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = i0; i < i1; ++i) hit |= match(L::load(row, i)) ? 1 : 0;
        if (hit) {
            for (int64_t i = i0; i < i1; ++i)
                if (match(L::load(row, i))) return i;
        }
    }
    return -1;
}

template <typename L>
int64_t row_argmax(const void* row, int64_t vocab) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = L::load(row, i);
        m = v > m ? v : m;
        nan |= v != v ? 1 : 0;
    }
    // torch's argmax: the first NaN if there is one, else the first maximum.
    const int64_t i = nan ? first_match<L>(row, vocab, [](float v) { return v != v; })
                          : first_match<L>(row, vocab, [m](float v) { return v == m; });
    return i < 0 ? 0 : i;
}

template <typename L>
float row_peak(const void* row, int64_t vocab, float t) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = L::load(row, i);
        m = v > m ? v : m;
    }
    // Division by t > 0 is monotonic: the largest z is the largest logit divided.
    return m / t;
}

// Sum of the candidates' weights over columns [c0, c1).
template <typename L, bool kThreshold>
float block_weight(const void* row, int64_t c0, int64_t c1, float t, float peak, float tz,
                   int64_t ti) {
#if defined(PAGEMILL_SAMPLER_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = c0; i < c1; i += 8)
        acc = _mm256_add_ps(acc, weights8<L, kThreshold>(row, i, c1, t, peak, tz, ti));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += lanes[j];
    return s;
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c0; i < c1; ++i) {
        const float z = L::load(row, i) / t;
        float w = weight_exp(z - peak);
        if (kThreshold) w = (z > tz || (z == tz && i < ti)) ? w : 0.0f;
        s += w;
    }
    return s;
#endif
}

// Whether no column of [c0, c1) can rank above threshold z `tz`: its largest logit
// divided by t (monotonic, so the largest z) is below it. One compare per column instead
// of a division and an exp: a top-p test's threshold is a likely token, above which
// almost every block of the row has nothing.
template <typename L>
bool block_below(const void* row, int64_t c0, int64_t c1, float t, float tz) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = c0; i < c1; ++i) {
        const float v = L::load(row, i);
        m = v > m ? v : m;
    }
    return m / t < tz;
}

template <typename L>
void row_block_sums(const void* row, int64_t vocab, float t, float peak, const float* tz,
                    const int64_t* ti, float* sums, int64_t nb, int64_t block) {
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = b * block;
        const int64_t c1 = c0 + block < vocab ? c0 + block : vocab;
        if (c0 >= vocab || (tz && block_below<L>(row, c0, c1, t, *tz)))
            sums[b] = 0.0f;
        else if (tz)
            sums[b] = block_weight<L, true>(row, c0, c1, t, peak, *tz, *ti);
        else
            sums[b] = block_weight<L, false>(row, c0, c1, t, peak, 0.0f, 0);
    }
}

// The first candidate whose running weight exceeds u x the row's candidate mass (float64
// running sums, blocks first), as `pick_in_blocks` in the sampler does it: a target
// rounded past the last block (or column) with weight takes that one; weight 0 is never
// chosen. Within the chosen block the target is placed as a share of the block's mass:
// `sums[b]` is an fp32 sum, ~1e-7 of itself away from the float64 sum of the weights walked
// here, and a remainder measured against one but walked against the other skipped the
// block's last candidates for a u near 1 (their weight below that rounding). `scratch`
// holds nb + block doubles.
template <typename L>
int64_t row_pick(const void* row, int64_t vocab, float t, float peak, const float* tz,
                 const int64_t* ti, const float* sums, int64_t nb, int64_t block, double u,
                 double* scratch) {
    double* cum = scratch;
    double* wb = scratch + nb;  // the chosen block's weights
    double acc = 0.0;
    int64_t last_b = 0;
    for (int64_t b = 0; b < nb; ++b) {
        acc += static_cast<double>(sums[b]);
        cum[b] = acc;
        if (sums[b] > 0.0f) last_b = b;
    }
    const double target = u * acc;
    int64_t b = 0;
    while (b < nb && cum[b] <= target) ++b;
    if (b > last_b) b = last_b;
    const double before = b > 0 ? cum[b - 1] : 0.0;
    const int64_t c0 = b * block;
    const int64_t c1 = std::min(vocab, c0 + block);
    double total = 0.0;
    int64_t last_j = 0;
#if defined(PAGEMILL_SAMPLER_AVX2)
    alignas(32) float ws[8];
#endif
    for (int64_t j = 0; j < c1 - c0; ++j) {
        const int64_t c = c0 + j;
#if defined(PAGEMILL_SAMPLER_AVX2)
        // The block's weights 8 at a time, as block_weight summed them.
        if (j % 8 == 0)
            _mm256_store_ps(ws, tz ? weights8<L, true>(row, c, c1, t, peak, *tz, *ti)
                                   : weights8<L, false>(row, c, c1, t, peak, 0.0f, 0));
        const float w = ws[j % 8];
#else
        const float z = L::load(row, c) / t;
        float w = weight_exp(z - peak);
        if (tz && !(z > *tz || (z == *tz && c < *ti))) w = 0.0f;
#endif
        wb[j] = w > 0.0f ? static_cast<double>(w) : 0.0;
        if (w > 0.0f) {
            last_j = j;
            total += static_cast<double>(w);
        }
    }
    const double rest = sums[b] > 0.0f ? (target - before) / sums[b] * total : 0.0;
    double inner = 0.0;
    for (int64_t j = 0; j <= last_j; ++j) {
        if (wb[j] > 0.0) {
            inner += wb[j];
            if (inner > rest) return c0 + j;
        }
    }
    return c0 + last_j;
}

// Ranking of the sampler: larger z first, equal z by smaller token id (a sort's order).
struct Ranked {
    float z;
    int64_t id;
};
inline bool ranks_above(const Ranked& a, const Ranked& b) {
    return a.z > b.z || (a.z == b.z && a.id < b.id);
}

// The k best of z = x / t in ranking order. A first pass takes each chunk's largest z (a
// vectorised max, then one division: it is monotonic); the k-th largest of those, theta,
// bounds the k-th best z from below (k chunks each hold a z >= theta). A second pass
// collects the z >= theta of the chunks that reach theta (about k chunks), and a partial
// sort of those few orders the head. NaN logits are never selected.
struct TopkScratch {
    std::vector<float> chunk_z;
    std::vector<float> order;
    std::vector<Ranked> cands;
};

template <typename L>
void row_topk(const void* row, int64_t vocab, float t, int64_t k, TopkScratch& sc,
              float* values, int64_t* ids) {
    const int64_t nc = (vocab + kChunk - 1) / kChunk;
    sc.chunk_z.resize(nc);
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t i0 = c * kChunk;
        const int64_t i1 = i0 + kChunk < vocab ? i0 + kChunk : vocab;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = i0; i < i1; ++i) {
            const float v = L::load(row, i);
            m = v > m ? v : m;
        }
        sc.chunk_z[c] = m / t;
    }
    float theta = -INFINITY;
    if (k <= nc) {
        sc.order.assign(sc.chunk_z.begin(), sc.chunk_z.end());
        std::nth_element(sc.order.begin(), sc.order.begin() + (k - 1), sc.order.end(),
                         [](float a, float b) { return a > b; });
        theta = sc.order[k - 1];
    }
    sc.cands.clear();
    float zs[kChunk];
    for (int64_t c = 0; c < nc; ++c) {
        if (!(sc.chunk_z[c] >= theta)) continue;
        const int64_t i0 = c * kChunk;
        const int64_t i1 = i0 + kChunk < vocab ? i0 + kChunk : vocab;
#pragma omp simd
        for (int64_t i = i0; i < i1; ++i) zs[i - i0] = L::load(row, i) / t;
        for (int64_t i = i0; i < i1; ++i)
            if (zs[i - i0] >= theta) sc.cands.push_back({zs[i - i0], i});
    }
    const int64_t have = static_cast<int64_t>(sc.cands.size()) < k
                             ? static_cast<int64_t>(sc.cands.size())
                             : k;
    std::partial_sort(sc.cands.begin(), sc.cands.begin() + have, sc.cands.end(), ranks_above);
    for (int64_t j = 0; j < k; ++j) {
        values[j] = j < have ? sc.cands[j].z : -INFINITY;
        ids[j] = j < have ? sc.cands[j].id : 0;
    }
}

// Scratch of one thread for `pagemill_sampler_penalize`: per token id, its count in the
// row's output and whether the row has seen it (prompt or output); `touched` lists the ids
// set, so that a row resets only those.
struct PenaltyScratch {
    std::vector<int32_t> count;
    std::vector<uint8_t> seen;
    std::vector<int64_t> touched;
};

inline void mark_seen(PenaltyScratch& sc, int64_t id) {
    if (!sc.seen[id]) {
        sc.seen[id] = 1;
        sc.touched.push_back(id);
    }
}

// Repetition, frequency and presence penalties of one fp32 row, at the ids it has seen
// only, with the torch path's arithmetic: a repetition penalty divides a positive logit
// and multiplies any other, then freq * count + presence is subtracted (product, sum and
// difference each rounded to fp32, as torch's three ops round them: `volatile` keeps
// -march=native from contracting the product and the sum into one fused multiply-add).
// Ids outside [0, vocab) have no logit and are skipped, as the torch path drops them.
void penalize_row(float* row, int64_t vocab, float rep, float freq, float pres,
                  const int64_t* prompt, int64_t prompt_len, const int64_t* output,
                  int64_t output_len, PenaltyScratch& sc) {
    const bool use_rep = rep != 1.0f;
    const bool use_out = freq != 0.0f || pres != 0.0f;
    if (!use_rep && !use_out) return;
    if (use_rep) {
        for (int64_t i = 0; i < prompt_len; ++i) {
            const int64_t id = prompt[i];
            if (id >= 0 && id < vocab) mark_seen(sc, id);
        }
    }
    for (int64_t i = 0; i < output_len; ++i) {
        const int64_t id = output[i];
        if (id < 0 || id >= vocab) continue;
        mark_seen(sc, id);
        ++sc.count[id];
    }
    for (const int64_t id : sc.touched) {
        float v = row[id];
        if (use_rep) v = v > 0.0f ? v / rep : v * rep;
        const int32_t c = sc.count[id];
        if (use_out && c > 0) {
            volatile float scaled = freq * static_cast<float>(c);
            const float total = scaled + pres;
            v = v - total;
        }
        row[id] = v;
        sc.count[id] = 0;
        sc.seen[id] = 0;
    }
    sc.touched.clear();
}

inline const void* row_ptr(const void* x, int dtype, int64_t stride, const int64_t* rows,
                           int64_t r) {
    const int64_t idx = rows ? rows[r] : r;
    const int64_t bytes = dtype == 0 ? 4 : 2;
    return static_cast<const char*>(x) + idx * stride * bytes;
}

}  // namespace

extern "C" {

// out[r] = argmax of row rows[r] (or r) of x; dtype 0 fp32, 1 bf16. Returns 0, or -1 for
// an unknown dtype.
int pagemill_sampler_argmax(int dtype, const void* x, int64_t stride, const int64_t* rows,
                            int64_t n, int64_t vocab, int64_t* out, int num_threads) {
    if (dtype != 0 && dtype != 1) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; ++r) {
        const void* row = row_ptr(x, dtype, stride, rows, r);
        out[r] = dtype == 0 ? row_argmax<F32>(row, vocab) : row_argmax<BF16>(row, vocab);
    }
    return 0;
}

// Per row r: peak[r] = the largest z = x / temperature[r] (when compute_peak, else read),
// then sums[r, b] = the candidates' sum of exp(z - peak[r]) over columns [b * block,
// (b + 1) * block). Candidates: every token when thr_z is null, else those ranked above
// (thr_z[r], thr_id[r]): z > thr_z, or z == thr_z with a smaller id.
int pagemill_sampler_block_sums(int dtype, const void* x, int64_t stride, const int64_t* rows,
                                int64_t n, int64_t vocab, const float* temperature, float* peak,
                                int compute_peak, const float* thr_z, const int64_t* thr_id,
                                float* sums, int64_t nb, int64_t block, int num_threads) {
    if (dtype != 0 && dtype != 1) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; ++r) {
        const void* row = row_ptr(x, dtype, stride, rows, r);
        const float t = temperature[r];
        const float* tz = thr_z ? thr_z + r : nullptr;
        const int64_t* ti = thr_id ? thr_id + r : nullptr;
        if (dtype == 0) {
            if (compute_peak) peak[r] = row_peak<F32>(row, vocab, t);
            row_block_sums<F32>(row, vocab, t, peak[r], tz, ti, sums + r * nb, nb, block);
        } else {
            if (compute_peak) peak[r] = row_peak<BF16>(row, vocab, t);
            row_block_sums<BF16>(row, vocab, t, peak[r], tz, ti, sums + r * nb, nb, block);
        }
    }
    return 0;
}

// out[r] = the token drawn with uniform u[r] from the candidates whose block sums are
// sums[r] (as pagemill_sampler_block_sums computed them, same thresholds).
int pagemill_sampler_pick(int dtype, const void* x, int64_t stride, const int64_t* rows,
                          int64_t n, int64_t vocab, const float* temperature, const float* peak,
                          const float* thr_z, const int64_t* thr_id, const float* sums,
                          int64_t nb, int64_t block, const double* u, int64_t* out,
                          int num_threads) {
    if (dtype != 0 && dtype != 1) return -1;
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        double* scratch = new double[nb + block];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            const void* row = row_ptr(x, dtype, stride, rows, r);
            const float* tz = thr_z ? thr_z + r : nullptr;
            const int64_t* ti = thr_id ? thr_id + r : nullptr;
            out[r] = dtype == 0 ? row_pick<F32>(row, vocab, temperature[r], peak[r], tz, ti,
                                                sums + r * nb, nb, block, u[r], scratch)
                                : row_pick<BF16>(row, vocab, temperature[r], peak[r], tz, ti,
                                                 sums + r * nb, nb, block, u[r], scratch);
        }
        delete[] scratch;
    }
    return 0;
}

// values[r, :k], ids[r, :k]: the k best tokens of z = x / temperature[r] in ranking order
// (larger z first, equal z by smaller id); 0 < k <= vocab.
int pagemill_sampler_topk(int dtype, const void* x, int64_t stride, const int64_t* rows,
                          int64_t n, int64_t vocab, const float* temperature, int64_t k,
                          float* values, int64_t* ids, int num_threads) {
    if ((dtype != 0 && dtype != 1) || k <= 0 || k > vocab) return -1;
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        TopkScratch scratch;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            const void* row = row_ptr(x, dtype, stride, rows, r);
            if (dtype == 0)
                row_topk<F32>(row, vocab, temperature[r], k, scratch, values + r * k, ids + r * k);
            else
                row_topk<BF16>(row, vocab, temperature[r], k, scratch, values + r * k, ids + r * k);
        }
    }
    return 0;
}

// The rules that change a few logits of a row, fused with the fp32 copy the sampler
// samples from: dst row r = src row r (fp32 or bf16, converted; skipped when `copy` is 0
// and dst is src), then logit_bias (bias_ids / bias_values [bias_off[r], bias_off[r+1])
// added), then the penalties of `penalize_row` from the row's distinct prompt ids and
// output ids (int64 arrays at the addresses prompt_ptr[r] / output_ptr[r], of
// prompt_len[r] / output_len[r] entries; length 0 for none). The torch path's order:
// bias first, so penalties see biased logits. Returns 0; -1 for an unknown dtype (or bf16
// in place); -2 for
// a bias id outside [0, vocab), with no row changed (checked before anything is written).
int pagemill_sampler_penalize(int dtype, const void* src, int64_t src_stride, float* dst,
                              int64_t dst_stride, int copy, int64_t n, int64_t vocab,
                              const float* repetition, const float* frequency,
                              const float* presence, const int64_t* prompt_ptr,
                              const int64_t* prompt_len, const int64_t* output_ptr,
                              const int64_t* output_len, const int64_t* bias_off,
                              const int64_t* bias_ids, const float* bias_values,
                              int num_threads) {
    if ((dtype != 0 && dtype != 1) || (!copy && dtype != 0)) return -1;
    if (bias_off) {
        for (int64_t i = 0; i < bias_off[n]; ++i)
            if (bias_ids[i] < 0 || bias_ids[i] >= vocab) return -2;
    }
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        PenaltyScratch sc;
        sc.count.assign(vocab, 0);
        sc.seen.assign(vocab, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            float* out = dst + r * dst_stride;
            if (copy) {
                if (dtype == 0) {
                    std::memcpy(out, static_cast<const float*>(src) + r * src_stride,
                                vocab * sizeof(float));
                } else {
                    const void* in = static_cast<const uint16_t*>(src) + r * src_stride;
#pragma omp simd
                    for (int64_t i = 0; i < vocab; ++i) out[i] = BF16::load(in, i);
                }
            }
            if (bias_off) {
                for (int64_t i = bias_off[r]; i < bias_off[r + 1]; ++i)
                    out[bias_ids[i]] += bias_values[i];
            }
            penalize_row(out, vocab, repetition[r], frequency[r], presence[r],
                         reinterpret_cast<const int64_t*>(prompt_ptr[r]), prompt_len[r],
                         reinterpret_cast<const int64_t*>(output_ptr[r]), output_len[r], sc);
        }
    }
    return 0;
}

}  // extern "C"
