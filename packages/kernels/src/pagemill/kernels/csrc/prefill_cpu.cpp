// Causal prefill attention on CPU for bf16: every prefill segment of a step (fresh prompts
// and chunks that extend a cached prefix alike) in one call, K/V read from the paged cache.
//
// Built at run time by pagemill.kernels.attention_cpu through cpu_native's builder (-O3
// -march=native -fopenmp), called through ctypes with raw pointers. Per-call costs, not
// arithmetic, dominate short prompts when each gets its own SDPA call per layer; here one
// parallel region serves the whole step.
//
// Two phases in one parallel region. First each (segment, KV head) pair's K and V are
// copied out of the cache once into the layouts `vdpbf16ps` reads (K: 16 keys x 2 dims per
// register; V: 2 keys x 16 dims per register); padding keys are zero. Then each work item
// (segment, query head, tile of 16 query rows) computes its rows' scores against every key
// up to its last row's position in fp32 (products of bf16 pairs, exact, summed in fp32),
// masks the keys past each row's position, takes a full-row softmax in fp32 (max, exp,
// sum), rounds the unnormalised weights to bf16 (as torch's CPU flash attention does before
// its second product), multiplies them with V and divides by the fp32 sum. A query row at
// position p sees keys 0..p, p = ctx - q_len + row.
//
// Without AVX512-BF16 the entry returns 2 and the caller keeps the torch path.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEMILL_PREFILL_AVX512 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx_tiles.h"
#endif

#ifdef PAGEMILL_PREFILL_AVX512
namespace {

constexpr int kTile = 16;  // query rows per work item, keys per K register

// e^x for finite x <= 0: 2^n * p(r), r = x - n ln2 in two parts, degree-6 polynomial
// (relative error ~1e-7); far below 0 scalef flushes to 0.
inline __m512 exp_le0(__m512 x) {
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
    return _mm512_scalef_ps(p, n);
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PAGEMILL_PREFILL_AMX 1

// The tiles need the kernel's permission once per process and a configuration per thread.
bool amx_usable() {
    static const bool ok = pagemill_amx::usable(pagemill_amx::BF16 | pagemill_amx::TILE);
    return ok;
}

// Every tile 16 rows x 64 bytes. Scores: q in 0..3 (32 dims each), K in 5 and 7, the
// products (16 rows x 16 keys, fp32) in 4 and 6. Output: the accumulators in 0..3 (16 dims
// each), the weights (16 rows x 32 keys) in 4, V in 5..7.
void configure_tiles() {
    pagemill_amx::TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    pagemill_amx::load_tile_config(cfg);
}
#else
bool amx_usable() { return false; }
#endif

struct Layout {
    int H, KVH, D, BS;
    int64_t q_s0, q_s1, o_s0, o_s1, table_stride;
};

// K of one (segment, KV head) as [ceil(ctx/16)][D/2][16 keys][2 dims], V as
// [ceil(ctx/32) * 16][D][2 keys]; keys past ctx are zero (a tile reads whole 32-key blocks).
void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int ctx, int kvh,
             const Layout& L, uint16_t* kp, uint16_t* vp) {
    const int D = L.D, half = D / 2;
    const int nkb = (ctx + 31) / 32 * 2;  // whole 32-key blocks, zero past ctx
    const int64_t tok = static_cast<int64_t>(L.KVH) * D;  // elements per cache slot
    std::memset(kp, 0, sizeof(uint16_t) * static_cast<size_t>(nkb) * kTile * D);
    std::memset(vp, 0, sizeof(uint16_t) * static_cast<size_t>(nkb) * kTile * D);
    // K: 16 keys at a time, each pair of dims gathered from the keys' rows (byte offsets
    // from the block's first key row fit 32 bits: the cache's blocks are addressed per key).
    for (int j0 = 0; j0 < ctx; j0 += kTile) {
        const int nk = std::min(kTile, ctx - j0);
        alignas(64) int64_t rows[kTile];
        for (int i = 0; i < kTile; ++i) {
            const int j = j0 + std::min(i, nk - 1);
            rows[i] = (static_cast<int64_t>(table[j / L.BS]) * L.BS + j % L.BS) * tok + kvh * D;
        }
        uint32_t* kdst = reinterpret_cast<uint32_t*>(kp) + static_cast<int64_t>(j0 / kTile) * half * kTile;
        const int64_t base = rows[0];
        bool near = true;
        alignas(64) int32_t idx[kTile];
        for (int i = 0; i < kTile; ++i) {
            const int64_t off = (rows[i] - base) * 2;
            near = near && off >= INT32_MIN && off <= INT32_MAX;
            idx[i] = static_cast<int32_t>(off);
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1);
        if (near) {
            const __m512i vi = _mm512_load_si512(idx);
            const char* b0 = reinterpret_cast<const char*>(kc + base);
            for (int p = 0; p < half; ++p)
                _mm512_storeu_si512(kdst + p * kTile,
                                    _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, vi,
                                                                b0 + 4 * p, 1));
        } else {
            for (int i = 0; i < nk; ++i) {
                const uint32_t* krow = reinterpret_cast<const uint32_t*>(kc + rows[i]);
                for (int p = 0; p < half; ++p) kdst[p * kTile + i] = krow[p];
            }
        }
    }
    // V: each pair of keys interleaved, 16 dims per register.
    for (int j = 0; j < ctx; j += 2) {
        const int64_t ra = (static_cast<int64_t>(table[j / L.BS]) * L.BS + j % L.BS) * tok + kvh * D;
        const bool two = j + 1 < ctx;
        const int64_t rb = two ? (static_cast<int64_t>(table[(j + 1) / L.BS]) * L.BS + (j + 1) % L.BS) * tok + kvh * D : ra;
        uint16_t* vdst = vp + static_cast<int64_t>(j / 2) * 2 * D;
        for (int d = 0; d < D; d += 16) {
            const __m512i va = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + ra + d)));
            __m512i vb = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vc + rb + d)));
            if (!two) vb = _mm512_setzero_si512();
            _mm512_storeu_si512(vdst + 2 * d, _mm512_or_si512(va, _mm512_slli_epi32(vb, 16)));
        }
    }
}

#ifdef PAGEMILL_PREFILL_AMX
// Scores of 16 query rows against nkb blocks of 16 keys, D = 32 * nd <= 128: q stays in
// tiles 0..nd-1, K blocks alternate between tiles 5 and 7 and the products between tiles
// 4 and 6, so consecutive tile instructions seldom wait on each other. (GCC's tile
// intrinsics take literal tile numbers, hence the spelled-out cases.)
#define PAGEMILL_QK_STEP(C, A, B, dc)                                                   \
    do {                                                                                \
        _tile_loadd(B, kp + (static_cast<int64_t>(kb) * half + (dc) * 16) * 2 * kTile, 64); \
        _tile_dpbf16ps(C, A, B);                                                        \
    } while (0)
#define PAGEMILL_QK_BLOCK(C)                                        \
    do {                                                            \
        _tile_zero(C);                                              \
        PAGEMILL_QK_STEP(C, 0, 5, 0);                               \
        if (nd > 1) PAGEMILL_QK_STEP(C, 1, 7, 1);                   \
        if (nd > 2) PAGEMILL_QK_STEP(C, 2, 5, 2);                   \
        if (nd > 3) PAGEMILL_QK_STEP(C, 3, 7, 3);                   \
        _tile_stored(C, S + kb * kTile, width * sizeof(float));     \
    } while (0)
void qk_amx(const uint16_t* qb, int64_t q_stride, const uint16_t* kp, int half, int nkb, int nd,
            float* S, int width) {
    _tile_loadd(0, qb, q_stride);
    if (nd > 1) _tile_loadd(1, qb + 32, q_stride);
    if (nd > 2) _tile_loadd(2, qb + 64, q_stride);
    if (nd > 3) _tile_loadd(3, qb + 96, q_stride);
    int kb = 0;
    for (; kb + 1 < nkb; ++kb) {
        PAGEMILL_QK_BLOCK(4);
        ++kb;
        PAGEMILL_QK_BLOCK(6);
    }
    if (kb < nkb) PAGEMILL_QK_BLOCK(4);
}
#undef PAGEMILL_QK_BLOCK
#undef PAGEMILL_QK_STEP
#endif

// One tile: rows r0..r0+m-1 of a segment (m <= 16) for query head h, on the matrix units
// (`amx`, tiles configured) or the vector units.
void tile(const uint16_t* q, uint16_t* out, const uint16_t* kp, const uint16_t* vp, int start,
          int q_len, int ctx, int r0, int m, int h, float scale, const Layout& L, bool amx,
          std::vector<float>& s_buf, std::vector<uint16_t>& p_buf) {
    const int D = L.D, half = D / 2;
    const int first = ctx - q_len;             // position of the segment's row 0
    const int nkeys = first + r0 + m;          // keys the tile's last row sees
    const int width = (nkeys + 31) / 32 * 32;  // scores per row: whole 32-key blocks
    const int nkb = width / kTile;
    s_buf.resize(static_cast<size_t>(kTile) * width);
    p_buf.resize(static_cast<size_t>(kTile) * width);
    alignas(64) uint16_t qb[kTile][256];  // the rows' q (zero past m), D <= 256
    for (int r = 0; r < kTile; ++r) {
        if (r < m) {
            const uint16_t* row = q + static_cast<int64_t>(start + r0 + r) * L.q_s0 + h * L.q_s1;
            std::memcpy(qb[r], row, sizeof(uint16_t) * D);
        } else {
            std::memset(qb[r], 0, sizeof(uint16_t) * D);
        }
    }
    float* S = s_buf.data();  // unscaled scores [16][width]
    if (amx) {
#ifdef PAGEMILL_PREFILL_AMX
        if (D <= 128) {
            qk_amx(&qb[0][0], sizeof(qb[0]), kp, half, nkb, D / 32, S, width);
        } else {
            for (int kb = 0; kb < nkb; ++kb) {
                _tile_zero(6);
                for (int dc = 0; dc < D / 32; ++dc) {
                    _tile_loadd(4, &qb[0][dc * 32], sizeof(qb[0]));
                    _tile_loadd(5, kp + (static_cast<int64_t>(kb) * half + dc * 16) * 2 * kTile, 64);
                    _tile_dpbf16ps(6, 4, 5);
                }
                _tile_stored(6, S + kb * kTile, width * sizeof(float));
            }
        }
#endif
    } else {
        const uint32_t(*qp)[128] = reinterpret_cast<const uint32_t(*)[128]>(qb);
        for (int kb = 0; kb < nkb; ++kb) {
            __m512 acc[kTile];
            for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
            const uint16_t* kblock = kp + static_cast<int64_t>(kb) * half * 2 * kTile;
            for (int p = 0; p < half; ++p) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(kblock + p * 2 * kTile);
#pragma GCC unroll 16
                for (int r = 0; r < kTile; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qp[r][p]), kv);
            }
            for (int r = 0; r < kTile; ++r)
                _mm512_storeu_ps(S + static_cast<int64_t>(r) * width + kb * kTile, acc[r]);
        }
    }
    // Softmax per row over keys 0..pos; weights past pos are 0.
    const __m512 vscale = _mm512_set1_ps(scale);
    float inv_sum[kTile];
    uint16_t* P = p_buf.data();
    for (int r = 0; r < kTile; ++r) {
        float* s = S + static_cast<int64_t>(r) * width;
        uint16_t* pr = P + static_cast<int64_t>(r) * width;
        if (r >= m) {
            std::memset(pr, 0, sizeof(uint16_t) * width);
            inv_sum[r] = 0.f;
            continue;
        }
        const int n = first + r0 + r + 1;  // keys this row sees
        const int nv = (n + 15) / 16 * 16;  // whole vectors reaching them; zero past
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < nv; c += 16) {
            const __mmask16 keep = c + 16 <= n ? 0xffff : (1u << (n - c)) - 1;
            vmax = _mm512_mask_max_ps(vmax, keep, vmax, _mm512_loadu_ps(s + c));
        }
        // scale > 0: the scaled scores' max is the scaled max
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
        __m512 vsum = _mm512_setzero_ps();
        for (int c = 0; c < nv; c += 16) {
            const __mmask16 keep = c + 16 <= n ? 0xffff : (1u << (n - c)) - 1;
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + c), vscale, mx);
            const __m512 e = _mm512_maskz_mov_ps(keep, exp_le0(x));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (nv < width) std::memset(pr + nv, 0, sizeof(uint16_t) * (width - nv));
        inv_sum[r] = 1.f / _mm512_reduce_add_ps(vsum);
    }
    // out = P V / sum, 16 output dims at a time.
    alignas(64) float o[4][kTile][16];
    auto store = [&](int dc, const float (*acc)[16]) {
        for (int r = 0; r < m; ++r) {
            uint16_t* orow = out + static_cast<int64_t>(start + r0 + r) * L.o_s0 + h * L.o_s1;
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(orow + dc * 16),
                (__m256i)_mm512_cvtneps_pbh(
                    _mm512_mul_ps(_mm512_load_ps(acc[r]), _mm512_set1_ps(inv_sum[r]))));
        }
    };
    if (amx) {
#ifdef PAGEMILL_PREFILL_AMX
        const int64_t vrow = 4 * static_cast<int64_t>(D);  // bytes between key pairs
        for (int dg = 0; dg < D / 16; dg += 4) {
            const int nd = std::min(4, D / 16 - dg);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kc = 0; kc < width; kc += 32) {
                _tile_loadd(4, P + kc, width * sizeof(uint16_t));
                const uint16_t* vb = vp + static_cast<int64_t>(kc) * D + dg * 32;
                _tile_loadd(5, vb, vrow);
                _tile_dpbf16ps(0, 4, 5);
                if (nd > 1) {
                    _tile_loadd(6, vb + 32, vrow);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (nd > 2) {
                    _tile_loadd(7, vb + 64, vrow);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nd > 3) {
                    _tile_loadd(5, vb + 96, vrow);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, o[0], 64);
            _tile_stored(1, o[1], 64);
            _tile_stored(2, o[2], 64);
            _tile_stored(3, o[3], 64);
            for (int i = 0; i < nd; ++i) store(dg + i, o[i]);
        }
#endif
        return;
    }
    const int npair = width / 2;
    const uint32_t* P32 = reinterpret_cast<const uint32_t*>(P);
    for (int dc = 0; dc < D / 16; ++dc) {
        __m512 acc[kTile];
        for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
        for (int j = 0; j < npair; ++j) {
            const __m512bh vv =
                (__m512bh)_mm512_loadu_si512(vp + static_cast<int64_t>(j) * 2 * D + dc * 32);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r)
                acc[r] = _mm512_dpbf16_ps(
                    acc[r], (__m512bh)_mm512_set1_epi32(P32[static_cast<int64_t>(r) * npair + j]),
                    vv);
        }
        for (int r = 0; r < kTile; ++r) _mm512_store_ps(o[0][r], acc[r]);
        store(dc, o[0]);
    }
}

}  // namespace
#endif

// Workspace elements (bf16) for segments of these context lengths: per (segment, KV head),
// K and V padded to whole 32-key blocks.
extern "C" int64_t pagemill_prefill_workspace(const int32_t* seg, int nseg, int kvh, int d) {
    int64_t total = 0;
    for (int s = 0; s < nseg; ++s) {
        const int64_t ctx = seg[3 * s + 2];
        total += 2 * ((ctx + 31) / 32 * 32) * d * kvh;
    }
    return total;
}

// seg: int32 [nseg][3] = (first row in q/out, q_len, ctx); tables: int32 rows of
// `table_stride`, one per segment, reaching each ctx. q/out: bf16 [T, H, D], last stride 1;
// caches bf16 [blocks, BS, KVH, D] contiguous; work: `work_numel` bf16 elements (see
// pagemill_prefill_workspace). allow_amx 0 keeps the vector kernel. Returns 0, or 1
// (arguments refused), or 2 (built without AVX512-BF16).
extern "C" int pagemill_prefill_causal(const void* q, int64_t q_s0, int64_t q_s1,
                                       const void* k_cache, const void* v_cache, void* out,
                                       int64_t o_s0, int64_t o_s1, const int32_t* seg,
                                       const int32_t* tables, int64_t table_stride, int nseg,
                                       int H, int KVH, int D, int BS, float scale, void* work,
                                       int64_t work_numel, int nthreads, int allow_amx) {
#ifndef PAGEMILL_PREFILL_AVX512
    (void)q; (void)q_s0; (void)q_s1; (void)k_cache; (void)v_cache; (void)out; (void)o_s0;
    (void)o_s1; (void)seg; (void)tables; (void)table_stride; (void)nseg; (void)H; (void)KVH;
    (void)D; (void)BS; (void)scale; (void)work; (void)work_numel; (void)nthreads;
    (void)allow_amx;
    return 2;
#else
    if (D % 32 != 0 || D > 256 || KVH <= 0 || H % KVH != 0 || BS <= 0 || nseg < 0) return 1;
    const Layout L{H, KVH, D, BS, q_s0, q_s1, o_s0, o_s1, table_stride};
    const int group = H / KVH;
    // Offsets of each (segment, KV head)'s packed K and V, and the work items.
    std::vector<int64_t> koff(static_cast<size_t>(nseg) * KVH), voff(koff.size());
    std::vector<int64_t> items;  // (segment, head, tile) packed as s * 2^32 + h * 2^16 + t
    int64_t at = 0;
    for (int s = 0; s < nseg; ++s) {
        const int q_len = seg[3 * s + 1], ctx = seg[3 * s + 2];
        if (q_len <= 0 || q_len > ctx) return 1;
        for (int g = 0; g < KVH; ++g) {
            koff[s * KVH + g] = at;
            at += static_cast<int64_t>((ctx + 31) / 32 * 32) * D;
            voff[s * KVH + g] = at;
            at += static_cast<int64_t>((ctx + 31) / 32 * 32) * D;
        }
        const int ntiles = (q_len + kTile - 1) / kTile;
        // Last tiles first: they see the most keys, so dynamic scheduling ends evenly.
        for (int t = ntiles - 1; t >= 0; --t)
            for (int h = 0; h < H; ++h)
                items.push_back((static_cast<int64_t>(s) << 32) | (h << 16) | t);
    }
    if (at > work_numel) return 1;
    const auto* qb = static_cast<const uint16_t*>(q);
    const auto* kc = static_cast<const uint16_t*>(k_cache);
    const auto* vc = static_cast<const uint16_t*>(v_cache);
    auto* ob = static_cast<uint16_t*>(out);
    auto* wb = static_cast<uint16_t*>(work);
    const int64_t npairs = static_cast<int64_t>(nseg) * KVH;
    const int64_t nitems = static_cast<int64_t>(items.size());
    const bool amx = allow_amx != 0 && amx_usable();
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < npairs; ++i) {
            const int s = static_cast<int>(i / KVH), g = static_cast<int>(i % KVH);
            pack_kv(kc, vc, tables + s * table_stride, seg[3 * s + 2], g, L, wb + koff[i],
                    wb + voff[i]);
        }
        std::vector<float> s_buf;
        std::vector<uint16_t> p_buf;
#ifdef PAGEMILL_PREFILL_AMX
        if (amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nitems; ++i) {
            const int s = static_cast<int>(items[i] >> 32);
            const int h = static_cast<int>((items[i] >> 16) & 0xffff), t = static_cast<int>(items[i] & 0xffff);
            const int q_len = seg[3 * s + 1];
            const int r0 = t * kTile, m = std::min(kTile, q_len - r0);
            const int64_t pair = static_cast<int64_t>(s) * KVH + h / group;
            tile(qb, ob, wb + koff[pair], wb + voff[pair], seg[3 * s], q_len, seg[3 * s + 2], r0, m,
                 h, scale, L, amx, s_buf, p_buf);
        }
#ifdef PAGEMILL_PREFILL_AMX
        if (amx) _tile_release();
#endif
    }
    return 0;
#endif
}
