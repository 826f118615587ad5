// torch.ops.pagemill_native.paged_decode / paged_decode_out / write_kv_cache: the CPU decode
// attention and KV write of paged_decode_cpu.cpp as real torch operators. Through ctypes each
// call also marshals two dozen Python arguments; a decode step of a small model makes one of
// each per layer, each moving little data at batch 1.
//
// Compiled as part of torch_ops_cpu.cpp against the running torch's headers and linked with
// paged_decode_cpu.cpp's object (the same -march=native code the ctypes path loads). The
// checks mirror cpu_native.supports and kv_cache.write_kv_cache_cpu_native; the Python side
// registers the fake (meta) kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>

extern "C" int pagemill_paged_decode(int dtype, const void* q, const void* k_cache,
                                     const void* v_cache, void* out,
                                     const int32_t* block_tables, int64_t table_stride,
                                     const int32_t* seq_lens, const int64_t* rows,
                                     int64_t num_seqs, int num_heads, int num_kv_heads,
                                     int head_dim, int block_size, int64_t q_stride_t,
                                     int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                                     float scale, int window, float softcap, int num_threads,
                                     const float* kv_lut, const float* k_scale,
                                     const float* v_scale, int64_t scale_stride,
                                     const float* sinks, int kv_format);
extern "C" int pagemill_reshape_and_cache(const void* k, const void* v, void* k_cache,
                                          void* v_cache, const int64_t* slots,
                                          int64_t num_tokens, int64_t k_stride,
                                          int64_t v_stride, int64_t row_bytes,
                                          int64_t num_slots);
extern "C" int pagemill_reshape_and_cache_quant(int dtype, int kv_format, const void* k,
                                                const void* v, void* k_cache, void* v_cache,
                                                const int64_t* slots, int64_t num_tokens,
                                                int64_t k_stride, int64_t v_stride, int heads,
                                                int dim, const float* k_scale,
                                                const float* v_scale, int64_t scale_stride,
                                                int64_t num_slots);

namespace {

int dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: return -1;
    }
}

bool is_byte_cache(at::ScalarType t) {
    return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar;
}

// The kernels' code of an 8-bit cache format (paged_decode_cpu.cpp: kE4M3, kE5M2, kInt8).
int byte_format(at::ScalarType t) {
    return t == at::kFloat8_e4m3fn ? 2 : t == at::kFloat8_e5m2 ? 3 : t == at::kChar ? 4 : 0;
}

// The 256 fp32 values of an 8-bit cache format by bit pattern (kv_quant.decode_table), made
// once per format.
const float* byte_table(at::ScalarType t) {
    static std::mutex mu;
    static at::Tensor tables[3];
    const int i = t == at::kFloat8_e4m3fn ? 0 : t == at::kFloat8_e5m2 ? 1 : 2;
    std::lock_guard<std::mutex> lock(mu);
    if (!tables[i].defined())
        tables[i] = at::arange(256, at::kInt).to(at::kByte).view(t).to(at::kFloat).contiguous();
    return tables[i].data_ptr<float>();
}

const at::Tensor& one() {
    static const at::Tensor t = at::ones({}, at::kFloat);
    return t;
}

void check_scale(const char* name, const at::Tensor& s, int64_t kv_heads) {
    TORCH_CHECK_VALUE(s.device().is_cpu() && s.scalar_type() == at::kFloat, name,
                      " must be a CPU fp32 tensor, got ", s.scalar_type(), " on ", s.device());
    TORCH_CHECK_VALUE(s.dim() == 0 || (s.dim() == 1 && s.size(0) == kv_heads && s.is_contiguous()),
                      name, " must be 0-dim or contiguous [", kv_heads, "], got ", s.sizes());
}

void paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& lens,
                      const std::optional<at::Tensor>& rows, double scale, int64_t window,
                      double softcap, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale,
                      const std::optional<at::Tensor>& sinks, at::Tensor& out) {
    const int code = dtype_code(q.scalar_type());
    TORCH_CHECK_VALUE(q.device().is_cpu() && code >= 0 && q.dim() == 3 && q.stride(2) == 1,
                      "paged_decode takes CPU fp32/bf16/fp16 q [T, H, D] with unit stride in D, got ",
                      q.sizes(), " ", q.scalar_type());
    TORCH_CHECK_VALUE(out.scalar_type() == q.scalar_type() && out.dim() == 3 &&
                          out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.stride(2) == 1 &&
                          out.size(0) >= q.size(0),
                      "paged_decode: out ", out.sizes(), " does not match q ", q.sizes());
    const bool bytes = is_byte_cache(k_cache.scalar_type());
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                          k_cache.scalar_type() == v_cache.scalar_type() &&
                          (k_cache.scalar_type() == q.scalar_type() || bytes) &&
                          k_cache.is_contiguous() && v_cache.is_contiguous() &&
                          k_cache.size(1) <= 256 && k_cache.size(3) <= 256 &&
                          k_cache.size(3) == q.size(2),
                      "paged_decode: caches ", k_cache.sizes(), " ", k_cache.scalar_type(),
                      " cannot serve q ", q.sizes(), " ", q.scalar_type());
    const int64_t num_seqs = tables.size(0);
    TORCH_CHECK_VALUE(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1 &&
                          lens.scalar_type() == at::kInt && lens.is_contiguous() &&
                          lens.numel() == num_seqs,
                      "paged_decode takes int32 tables [S, W] and contiguous int32 lens [S]");
    const int64_t* row_ptr = nullptr;
    if (rows.has_value()) {
        TORCH_CHECK_VALUE(rows->scalar_type() == at::kLong && rows->is_contiguous() &&
                              rows->numel() == num_seqs,
                          "paged_decode takes contiguous int64 rows [S]");
        row_ptr = rows->data_ptr<int64_t>();
    } else {
        TORCH_CHECK_VALUE(q.size(0) >= num_seqs, "paged_decode: ", num_seqs, " requests but q has ",
                          q.size(0), " rows");
    }
    const int64_t kv_heads = k_cache.size(2);
    const float* sink_ptr = nullptr;
    if (sinks.has_value()) {
        TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                              sinks->numel() == q.size(1),
                          "paged_decode takes contiguous fp32 sinks [num_heads]");
        sink_ptr = sinks->data_ptr<float>();
    }
    // Scales only for an 8-bit cache (a cache in the compute dtype ignores them).
    at::Tensor ks = bytes && k_scale.has_value() ? *k_scale : one();
    at::Tensor vs = bytes && v_scale.has_value() ? *v_scale : one();
    check_scale("k_scale", ks, kv_heads);
    check_scale("v_scale", vs, kv_heads);
    if (ks.dim() != vs.dim()) {
        ks = ks.expand({kv_heads}).contiguous();
        vs = vs.expand({kv_heads}).contiguous();
    }
    const int status = pagemill_paged_decode(
        code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr<int32_t>(), tables.stride(0), lens.data_ptr<int32_t>(), row_ptr, num_seqs,
        static_cast<int>(q.size(1)), static_cast<int>(kv_heads), static_cast<int>(k_cache.size(3)),
        static_cast<int>(k_cache.size(1)), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap),
        at::get_num_threads(), bytes ? byte_table(k_cache.scalar_type()) : nullptr,
        ks.data_ptr<float>(), vs.data_ptr<float>(), ks.dim(), sink_ptr,
        byte_format(k_cache.scalar_type()));
    TORCH_CHECK(status == 0, "paged_decode_cpu refused its arguments (status ", status, ")");
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens,
                        const std::optional<at::Tensor>& rows, double scale, int64_t window,
                        double softcap, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale,
                        const std::optional<at::Tensor>& sinks) {
    at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
    paged_decode_out(q, k_cache, v_cache, tables, lens, rows, scale, window, softcap, k_scale,
                     v_scale, sinks, out);
    return out;
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
    TORCH_CHECK_VALUE(
        k.device().is_cpu() && k_cache.device().is_cpu() && slot_mapping.device().is_cpu() &&
            k.scalar_type() == v.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
            k.scalar_type() == v_cache.scalar_type() && k.dim() == 3 && k.sizes() == v.sizes() &&
            k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
            v_cache.is_contiguous() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) &&
            k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
            v.stride(1) == v.size(2) && slot_mapping.dim() == 1 &&
            slot_mapping.size(0) == k.size(0) &&
            (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
        "write_kv_cache: k ", k.sizes(), " ", k.scalar_type(), " into caches ", k_cache.sizes(),
        " ", k_cache.scalar_type(), " at slots ", slot_mapping.sizes(),
        " is not a write the native kernel serves");
    const int64_t n = k.size(0);
    if (n == 0) return;
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t esize = k.element_size();
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int status = pagemill_reshape_and_cache(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr<int64_t>(),
        n, k.stride(0) * esize, v.stride(0) * esize, k.size(1) * k.size(2) * esize, num_slots);
    TORCH_CHECK_VALUE(status == 0, "write_kv_cache: a slot is outside the cache (", num_slots,
                      " slots)");
}

// The write into an fp8 or int8 cache (kv_quant.quantize's contract): k/v in a float dtype,
// quantized with the layer's scales (0-dim, [kv_heads], or none: 1) as they are stored.
void write_kv_cache_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale) {
    const int code = dtype_code(k.scalar_type());
    const int format = byte_format(k_cache.scalar_type());
    TORCH_CHECK_VALUE(
        k.device().is_cpu() && k_cache.device().is_cpu() && slot_mapping.device().is_cpu() &&
            code >= 0 && format > 0 && k.scalar_type() == v.scalar_type() &&
            k_cache.scalar_type() == v_cache.scalar_type() && k.dim() == 3 &&
            k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
            k_cache.is_contiguous() && v_cache.is_contiguous() && k.size(1) == k_cache.size(2) &&
            k.size(2) == k_cache.size(3) && k.stride(2) == 1 && v.stride(2) == 1 &&
            k.stride(1) == k.size(2) && v.stride(1) == v.size(2) && slot_mapping.dim() == 1 &&
            slot_mapping.size(0) == k.size(0) &&
            (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
        "write_kv_cache_quant: k ", k.sizes(), " ", k.scalar_type(), " into caches ",
        k_cache.sizes(), " ", k_cache.scalar_type(), " at slots ", slot_mapping.sizes(),
        " is not a write the native kernel serves");
    const int64_t kv_heads = k_cache.size(2);
    if (k_scale.has_value()) check_scale("k_scale", *k_scale, kv_heads);
    if (v_scale.has_value()) check_scale("v_scale", *v_scale, kv_heads);
    at::Tensor ks = k_scale.has_value() ? *k_scale : one();
    at::Tensor vs = v_scale.has_value() ? *v_scale : one();
    if (ks.dim() != vs.dim()) {
        ks = ks.expand({kv_heads}).contiguous();
        vs = vs.expand({kv_heads}).contiguous();
    }
    const int64_t n = k.size(0);
    if (n == 0) return;
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int status = pagemill_reshape_and_cache_quant(
        code, format, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr<int64_t>(), n, k.stride(0), v.stride(0), static_cast<int>(kv_heads),
        static_cast<int>(k.size(2)), ks.data_ptr<float>(), vs.data_ptr<float>(), ks.dim(),
        num_slots);
    TORCH_CHECK_VALUE(status != 1, "write_kv_cache_quant: a slot is outside the cache (",
                      num_slots, " slots)");
    TORCH_CHECK(status == 0, "write_kv_cache_quant refused its arguments (status ", status, ")");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagemill_native, m) {
    m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
          "Tensor? rows, float scale, int window=0, float softcap=0.0, Tensor? k_scale=None, "
          "Tensor? v_scale=None, Tensor? sinks=None) -> Tensor");
    m.def("paged_decode_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, "
          "Tensor? rows, float scale, int window, float softcap, Tensor? k_scale, Tensor? v_scale, "
          "Tensor? sinks, Tensor(a!) out) -> ()");
    m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor slot_mapping) -> ()");
    m.def("write_kv_cache_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagemill_native, CPU, m) {
    m.impl("paged_decode", &paged_decode);
    m.impl("paged_decode_out", &paged_decode_out);
    m.impl("write_kv_cache", &write_kv_cache);
    m.impl("write_kv_cache_quant", &write_kv_cache_quant);
}
