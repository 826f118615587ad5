// Batched LoRA on CPU: y[t] += (x[t] A[slot(t)]^T) B[slot(t)]^T for every adapter token of a
// step, in one call per projection.
//
// Built at run time by pagemill.kernels.lora_cpu with the host's compiler (-O3
// -march=native -fopenmp) and called through ctypes with raw pointers (no torch headers).
// The torch path pays per adapter slot a shrink GEMM, an expand GEMM, a cast and a
// mixed-dtype add, each a dispatch with its own overhead, on a block-diagonal B whose
// zeros it multiplies too; at the widths of small models that overhead is most of the
// cost. Here a task is up to 8 tokens of one slot (rows read and written in place through
// `sorted_ids`, so the tokens need not be contiguous): their x rows widened to fp32 once,
// the shrink over the slot's A rows, then the expand slice by slice over B's non-zero block
// only, accumulated in registers and added into y's rows (bf16 rounded to nearest even,
// as torch does). Tasks run in parallel over OpenMP threads; base tokens are never read
// or written.
//
// Layouts: A [L, S*R, K] contiguous fp32; B stored transposed, [L, S*R, out] contiguous
// fp32 (row j*R + r of slice j spans only that slice's output columns), so the expand
// reads B rows along the output with wide vector loads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTokens = 8;  // tokens per task (register blocking of both GEMMs)
constexpr int kLanes = 16;

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
}

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet (torch's rule)
    if (f != f) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return uint16_t(u >> 16);
}

// h[t][c] = x[t] . A[c] for NT tokens (xf: NT rows of K floats) and the slot's SR rows of A,
// two A rows at a time so each x load feeds two FMAs.
template <int NT>
void shrink(const float* xf, const float* a, int sr, int64_t k, float* h) {
    int c = 0;
    const int64_t kv = k - k % kLanes;
    for (; c + 2 <= sr; c += 2) {
        const float* a0 = a + c * k;
        const float* a1 = a0 + k;
        vf acc0[NT], acc1[NT];
        for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = vf{};
        for (int64_t i = 0; i < kv; i += kLanes) {
            const vf va0 = load(a0 + i), va1 = load(a1 + i);
            for (int t = 0; t < NT; ++t) {
                const vf vx = load(xf + t * k + i);
                acc0[t] += vx * va0;
                acc1[t] += vx * va1;
            }
        }
        for (int t = 0; t < NT; ++t) {
            float s0 = hsum(acc0[t]), s1 = hsum(acc1[t]);
            for (int64_t i = kv; i < k; ++i) {
                s0 += xf[t * k + i] * a0[i];
                s1 += xf[t * k + i] * a1[i];
            }
            h[t * sr + c] = s0;
            h[t * sr + c + 1] = s1;
        }
    }
    for (; c < sr; ++c) {
        const float* a0 = a + c * k;
        for (int t = 0; t < NT; ++t) {
            float s = 0.f;
            for (int64_t i = 0; i < k; ++i) s += xf[t * k + i] * a0[i];
            h[t * sr + c] = s;
        }
    }
}

template <typename Y>
inline void add_row(Y* y, const float* d, int n);

template <>
inline void add_row<float>(float* y, const float* d, int n) {
    for (int i = 0; i < n; ++i) y[i] += d[i];
}

template <>
inline void add_row<uint16_t>(uint16_t* y, const float* d, int n) {
    for (int i = 0; i < n; ++i) y[i] = f32_to_bf16(bf16_to_f32(y[i]) + d[i]);
}

// y rows += h B^T over each slice's own block: 32 output columns at a time, the rank walked
// with one broadcast of h per token and two B loads shared by every token.
template <int NT, typename Y>
void expand(const float* h, const float* bt, const int32_t* slice_starts, int num_slices,
            int rank, int64_t out, Y* const* rows) {
    const int sr = num_slices * rank;
    for (int j = 0; j < num_slices; ++j) {
        const int64_t lo = slice_starts[j], hi = slice_starts[j + 1];
        int64_t o = lo;
        for (; o + 2 * kLanes <= hi; o += 2 * kLanes) {
            vf acc0[NT], acc1[NT];
            for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = vf{};
            for (int r = 0; r < rank; ++r) {
                const int c = j * rank + r;
                const float* b = bt + c * out + o;
                const vf b0 = load(b), b1 = load(b + kLanes);
                for (int t = 0; t < NT; ++t) {
                    const float hv = h[t * sr + c];
                    acc0[t] += hv * b0;
                    acc1[t] += hv * b1;
                }
            }
            for (int t = 0; t < NT; ++t) {
                float d[2 * kLanes];
                std::memcpy(d, &acc0[t], sizeof(vf));
                std::memcpy(d + kLanes, &acc1[t], sizeof(vf));
                add_row(rows[t] + o, d, 2 * kLanes);
            }
        }
        if (o < hi) {  // the slice's last columns (fewer than 32)
            const int n = int(hi - o);
            for (int t = 0; t < NT; ++t) {
                float d[2 * kLanes] = {};
                for (int r = 0; r < rank; ++r) {
                    const int c = j * rank + r;
                    const float hv = h[t * sr + c];
                    const float* b = bt + c * out + o;
                    for (int i = 0; i < n; ++i) d[i] += hv * b[i];
                }
                add_row(rows[t] + o, d, n);
            }
        }
    }
}

template <typename X>
inline void widen(const X* x, float* xf, int64_t k);

template <>
inline void widen<float>(const float* x, float* xf, int64_t k) {
    std::memcpy(xf, x, k * sizeof(float));
}

template <>
inline void widen<uint16_t>(const uint16_t* x, float* xf, int64_t k) {
    for (int64_t i = 0; i < k; ++i) xf[i] = bf16_to_f32(x[i]);
}

template <int NT, typename X, typename Y>
void task(const X* x, int64_t x_stride, Y* y, int64_t y_stride, const float* a, const float* bt,
          const int32_t* ids, const int32_t* slice_starts, int num_slices, int rank, int64_t k,
          int64_t out, float* xf, float* h) {
    Y* rows[NT];
    for (int t = 0; t < NT; ++t) {
        widen(x + int64_t(ids[t]) * x_stride, xf + t * k, k);
        rows[t] = y + int64_t(ids[t]) * y_stride;
    }
    shrink<NT>(xf, a, num_slices * rank, k, h);
    expand<NT, Y>(h, bt, slice_starts, num_slices, rank, out, rows);
}

template <typename X, typename Y>
int run(const X* x, int64_t x_stride, Y* y, int64_t y_stride, const float* a, const float* bt,
        const int32_t* sorted_ids, const int32_t* seg_starts, int num_slots,
        const int32_t* slice_starts, int num_slices, int rank, int64_t k, int64_t out,
        int64_t num_tokens, int num_threads) {
    // Bounds first: every row this call touches lies in x and y, every slice in y's row.
    if (seg_starts[0] != 0 || slice_starts[0] != 0 || slice_starts[num_slices] != out) return 2;
    for (int j = 0; j < num_slices; ++j)
        if (slice_starts[j + 1] < slice_starts[j]) return 2;
    for (int s = 0; s < num_slots; ++s)
        if (seg_starts[s + 1] < seg_starts[s] || seg_starts[s + 1] > num_tokens) return 2;
    for (int i = 0; i < seg_starts[num_slots]; ++i)
        if (sorted_ids[i] < 0 || sorted_ids[i] >= num_tokens) return 2;
    struct Task {
        int slot, begin, n;
    };
    std::vector<Task> tasks;
    for (int s = 0; s < num_slots; ++s)
        for (int b = seg_starts[s]; b < seg_starts[s + 1]; b += kTokens)
            tasks.push_back({s, b, std::min(kTokens, seg_starts[s + 1] - b)});
    const int64_t sr = int64_t(num_slices) * rank;
    const int64_t n_tasks = int64_t(tasks.size());
    const int threads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, n_tasks)));
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> xf(kTokens * k), h(kTokens * sr);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; ++i) {
            const Task& tk = tasks[i];
            const float* as = a + tk.slot * sr * k;
            const float* bs = bt + tk.slot * sr * out;
            const int32_t* ids = sorted_ids + tk.begin;
#define PAGEMILL_LORA_TASK(NT)                                                                 \
    case NT:                                                                                   \
        task<NT>(x, x_stride, y, y_stride, as, bs, ids, slice_starts, num_slices, rank, k, out, \
                 xf.data(), h.data());                                                         \
        break;
            switch (tk.n) {
                PAGEMILL_LORA_TASK(1)
                PAGEMILL_LORA_TASK(2)
                PAGEMILL_LORA_TASK(3)
                PAGEMILL_LORA_TASK(4)
                PAGEMILL_LORA_TASK(5)
                PAGEMILL_LORA_TASK(6)
                PAGEMILL_LORA_TASK(7)
                PAGEMILL_LORA_TASK(8)
            }
#undef PAGEMILL_LORA_TASK
        }
    }
    return 0;
}

}  // namespace

// dtype codes: 0 float32, 1 bfloat16 (x and y each); A and B are float32; x and y have
// num_tokens rows. Returns 0; 1 for arguments this kernel does not serve, 2 for a mapping
// or slices that reach outside x or y (nothing is written then).
extern "C" int pagemill_add_lora(int x_dtype, const void* x, int64_t x_stride, int y_dtype,
                                 void* y, int64_t y_stride, const float* a, const float* bt,
                                 const int32_t* sorted_ids, const int32_t* seg_starts,
                                 int num_slots, const int32_t* slice_starts, int num_slices,
                                 int rank, int64_t k, int64_t out, int64_t num_tokens,
                                 int num_threads) {
    if (num_slices < 1 || rank < 1 || k < 1 || out < 1 || x_dtype < 0 || x_dtype > 1 ||
        y_dtype < 0 || y_dtype > 1)
        return 1;
    const auto* xf = static_cast<const float*>(x);
    const auto* xb = static_cast<const uint16_t*>(x);
    auto* yf = static_cast<float*>(y);
    auto* yb = static_cast<uint16_t*>(y);
    if (x_dtype == 0 && y_dtype == 0)
        return run(xf, x_stride, yf, y_stride, a, bt, sorted_ids, seg_starts, num_slots,
                   slice_starts, num_slices, rank, k, out, num_tokens, num_threads);
    if (x_dtype == 0)
        return run(xf, x_stride, yb, y_stride, a, bt, sorted_ids, seg_starts, num_slots,
                   slice_starts, num_slices, rank, k, out, num_tokens, num_threads);
    if (y_dtype == 0)
        return run(xb, x_stride, yf, y_stride, a, bt, sorted_ids, seg_starts, num_slots,
                   slice_starts, num_slices, rank, k, out, num_tokens, num_threads);
    return run(xb, x_stride, yb, y_stride, a, bt, sorted_ids, seg_starts, num_slots,
               slice_starts, num_slices, rank, k, out, num_tokens, num_threads);
}
