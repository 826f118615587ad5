// C entry points for the pagemill_native operators in the form inductor's C++ wrapper calls
// directly (`torch._inductor.config.aot_inductor.custom_ops_to_c_shims`): a compiled graph
// with a C++ wrapper otherwise reaches a custom operator through
// `aoti_torch_call_dispatcher`, which finds the operator by name, boxes every argument into
// a stack, runs the boxed kernel and unboxes the result, on every call. A batch-1 decode
// step of a small model makes a few hundred such calls, each moving little data, so that
// toll is a visible share of the step; through these it is one C call.
//
// Each shim takes the operator's arguments in the wrapper's ABI (a Tensor as an
// AtenTensorHandle, a Tensor? as a pointer to one or null, an int as int64_t, a bool as
// int32_t, a float as double, a returned Tensor through `ret0`; an operator returning nothing
// still gets a `ret0`, null, for its one "None" output) and runs the same function
// the dispatcher would, so the checks and the result are the operator's own. The names are
// inductor's, `aoti_torch_<device>_<operator name>`; cpu_native.c_shims() lists the
// declarations, which must match these.
//
// Each call is a profiler event named as the operator (`pagemill_native::...`), as a call
// through the dispatcher is, so torch.profiler still sees which operators a step ran; with no
// profiler on that costs a check of its callbacks.
//
// Included at the end of torch_ops_cpu.cpp, after the operators' definitions.

#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#define PAGEMILL_SHIM extern "C" __attribute__((visibility("default"))) AOTITorchError

namespace {

const at::Tensor& shim_tensor(AtenTensorHandle h) {
    return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

at::Tensor& shim_tensor_mut(AtenTensorHandle h) {
    return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

std::optional<at::Tensor> shim_optional(const AtenTensorHandle* h) {
    return h == nullptr ? std::nullopt : std::optional<at::Tensor>(shim_tensor(*h));
}

// A profiler event around the call while a profiler (any RecordFunction callback) is on.
struct ShimEvent {
    at::RecordFunction guard{at::RecordScope::FUNCTION};
    explicit ShimEvent(const char* name) {
        if (C10_UNLIKELY(guard.isActive())) {
            guard.before(name);
        }
    }
};

}  // namespace

// The packed-weight products taking (x, blocks, n, planes) and returning their output.
#define PAGEMILL_PACKED_PRODUCT_SHIM(op)                                                      \
    PAGEMILL_SHIM aoti_torch_cpu_##op(AtenTensorHandle x, AtenTensorHandle blocks, int64_t n,  \
                                      int64_t planes, AtenTensorHandle* ret0) {               \
        AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                          \
            const ShimEvent event("pagemill_native::" #op);                                   \
            *ret0 = torch::aot_inductor::new_tensor_handle(                                   \
                op(shim_tensor(x), shim_tensor(blocks), n, planes));                          \
        });                                                                                   \
    }

PAGEMILL_PACKED_PRODUCT_SHIM(gemv_q4)
PAGEMILL_PACKED_PRODUCT_SHIM(gemv_q8)
PAGEMILL_PACKED_PRODUCT_SHIM(gemm_q4_amx)

PAGEMILL_SHIM aoti_torch_cpu_gemm_q8_amx(AtenTensorHandle x, AtenTensorHandle blocks, int64_t n,
                                         int32_t bf16_scales, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::gemm_q8_amx");
        *ret0 = torch::aot_inductor::new_tensor_handle(
            gemm_q8_amx(shim_tensor(x), shim_tensor(blocks), n, bf16_scales != 0));
    });
}

PAGEMILL_SHIM aoti_torch_cpu_gemm_q4_amx_silu_mul(AtenTensorHandle x, AtenTensorHandle blocks,
                                                  int64_t n, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::gemm_q4_amx_silu_mul");
        *ret0 = torch::aot_inductor::new_tensor_handle(
            gemm_q4_amx_silu_mul(shim_tensor(x), shim_tensor(blocks), n));
    });
}

PAGEMILL_SHIM aoti_torch_cpu_paged_decode(AtenTensorHandle q, AtenTensorHandle k_cache,
                                          AtenTensorHandle v_cache, AtenTensorHandle tables,
                                          AtenTensorHandle lens, AtenTensorHandle* rows,
                                          double scale, int64_t window, double softcap,
                                          AtenTensorHandle* k_scale, AtenTensorHandle* v_scale,
                                          AtenTensorHandle* sinks, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::paged_decode");
        *ret0 = torch::aot_inductor::new_tensor_handle(paged_decode(
            shim_tensor(q), shim_tensor(k_cache), shim_tensor(v_cache), shim_tensor(tables),
            shim_tensor(lens), shim_optional(rows), scale, window, softcap,
            shim_optional(k_scale), shim_optional(v_scale), shim_optional(sinks)));
    });
}

PAGEMILL_SHIM aoti_torch_cpu_paged_decode_out(
    AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle tables,
    AtenTensorHandle lens, AtenTensorHandle* rows, double scale, int64_t window, double softcap,
    AtenTensorHandle* k_scale, AtenTensorHandle* v_scale, AtenTensorHandle* sinks,
    AtenTensorHandle out, AtenTensorHandle* /*ret0: no result, null*/) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::paged_decode_out");
        paged_decode_out(shim_tensor(q), shim_tensor(k_cache), shim_tensor(v_cache),
                         shim_tensor(tables), shim_tensor(lens), shim_optional(rows), scale,
                         window, softcap, shim_optional(k_scale), shim_optional(v_scale),
                         shim_optional(sinks), shim_tensor_mut(out));
    });
}

PAGEMILL_SHIM aoti_torch_cpu_write_kv_cache(AtenTensorHandle k, AtenTensorHandle v,
                                            AtenTensorHandle k_cache, AtenTensorHandle v_cache,
                                            AtenTensorHandle slot_mapping,
                                            AtenTensorHandle* /*ret0: no result, null*/) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::write_kv_cache");
        write_kv_cache(shim_tensor(k), shim_tensor(v), shim_tensor_mut(k_cache),
                       shim_tensor_mut(v_cache), shim_tensor(slot_mapping));
    });
}

PAGEMILL_SHIM aoti_torch_cpu_write_kv_cache_quant(AtenTensorHandle k, AtenTensorHandle v,
                                                  AtenTensorHandle k_cache,
                                                  AtenTensorHandle v_cache,
                                                  AtenTensorHandle slot_mapping,
                                                  AtenTensorHandle* k_scale,
                                                  AtenTensorHandle* v_scale,
                                                  AtenTensorHandle* /*ret0: no result, null*/) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const ShimEvent event("pagemill_native::write_kv_cache_quant");
        write_kv_cache_quant(shim_tensor(k), shim_tensor(v), shim_tensor_mut(k_cache),
                             shim_tensor_mut(v_cache), shim_tensor(slot_mapping),
                             shim_optional(k_scale), shim_optional(v_scale));
    });
}

#undef PAGEMILL_SHIM
