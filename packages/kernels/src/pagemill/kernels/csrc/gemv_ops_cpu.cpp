// torch.ops.pagemill_native.gemv_q4 / gemv_q8 / gemm_q4_amx / gemm_q8_amx: the packed-weight
// kernels of gemv_q4_cpu.cpp and gemv_q8_cpu.cpp as real torch operators, so that a compiled
// graph (and an eager caller) reaches them through the dispatcher alone. Through a Python
// custom op every call also ran a Python function and a ctypes call; a decode step of a small
// model makes over a hundred of them, each moving little data.
//
// Compiled as part of torch_ops_cpu.cpp against the running torch's headers and linked with
// the two kernel sources' objects (the same -march=native objects the ctypes libraries hold). The checks mirror gemv_q4_cpu.supports / gemv_q8_cpu.supports;
// the Python side registers the fake (meta) kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

extern "C" int pagemill_gemv_q4(int dtype, const void* x, int64_t x_stride, const void* w,
                                int scale_bytes, void* y, int64_t y_stride, int64_t m_rows,
                                int64_t n, int64_t k, int threads, int planes);
extern "C" int pagemill_gemm_q4_amx(int dtype, const void* x, int64_t x_stride, const void* w,
                                    int scale_bytes, void* y, int64_t y_stride, int64_t m_rows,
                                    int64_t n, int64_t k, int threads, int planes);
extern "C" int pagemill_gemv_q8(int dtype, const void* x, int64_t x_stride, const void* w,
                                void* y, int64_t y_stride, int64_t m_rows, int64_t n, int64_t k,
                                int threads, int planes);
extern "C" int pagemill_gemm_q8_amx(int dtype, const void* x, int64_t x_stride, const void* w,
                                    void* y, int64_t y_stride, int64_t m_rows, int64_t n,
                                    int64_t k, int threads, int bf16_scales);

namespace {

constexpr int64_t QK = 32;
constexpr int64_t ROWS = 16;
constexpr int64_t Q4_QS_BYTES = ROWS * QK / 2;
constexpr int64_t Q8_BLOCK_BYTES = 2 * ROWS + ROWS * QK;

int dtype_code(const at::Tensor& x) {
    return x.scalar_type() == at::kBFloat16 ? 1 : 0;
}

void check_x(const char* op, const at::Tensor& x, const at::Tensor& blocks, int64_t n,
             int64_t planes) {
    TORCH_CHECK(planes == 1 || planes == 2, op, " takes 1 or 2 activation planes, not ", planes);
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                op, " takes CPU fp32/bf16 x [M, K], got ", x.sizes(), " ", x.scalar_type());
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 3,
                op, " takes uint8 tiles [tiles, K / 32, bytes], got ", blocks.sizes(), " ",
                blocks.scalar_type());
    TORCH_CHECK(x.size(1) == blocks.size(1) * QK && n >= 0 && n <= blocks.size(0) * ROWS, op,
                ": x ", x.sizes(), " and tiles ", blocks.sizes(), " do not give N = ", n);
}

// Bytes per block of a q4 tile (fp16 or fp32 scales), checked.
int64_t q4_tile_width(const char* name, const at::Tensor& blocks) {
    const int64_t width = blocks.size(2);
    TORCH_CHECK(width == Q4_QS_BYTES + 4 * ROWS || width == Q4_QS_BYTES + 8 * ROWS, name,
                " tiles are 320 or 384 bytes per block, got ", width);
    return width;
}

at::Tensor gemv_q4(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t n,
                   int64_t planes) {
    check_x("gemv_q4", x_in, blocks_in, n, planes);
    const int64_t width = q4_tile_width("gemv_q4", blocks_in);
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor blocks = blocks_in.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int status = pagemill_gemv_q4(
        dtype_code(x), x.data_ptr(), x.stride(0), blocks.data_ptr(),
        static_cast<int>((width - Q4_QS_BYTES) / (2 * ROWS)), y.data_ptr(), n, x.size(0), n,
        x.size(1), at::get_num_threads(), static_cast<int>(planes));
    TORCH_CHECK(status == 0, "gemv_q4_cpu refused its arguments (status ", status, ")");
    return y;
}

// gemv_q4's product on the AMX tiles (planes 1, 2: the same result to the bit; 0: bf16
// weight tiles, the dense bf16 product). Without AMX, planes 1 and 2 run gemv_q4; planes 0
// has no native fallback (the Python op's is a dequantized copy): callers check
// gemv_q4_cpu.amx_available() before routing to it.
at::Tensor gemm_q4_amx(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t n,
                       int64_t planes) {
    TORCH_CHECK(planes >= 0 && planes <= 2, "gemm_q4_amx takes 0, 1 or 2 planes, not ", planes);
    check_x("gemm_q4_amx", x_in, blocks_in, n, planes == 0 ? 1 : planes);
    const int64_t width = q4_tile_width("gemm_q4_amx", blocks_in);
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor blocks = blocks_in.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int scale_bytes = static_cast<int>((width - Q4_QS_BYTES) / (2 * ROWS));
    int status = pagemill_gemm_q4_amx(dtype_code(x), x.data_ptr(), x.stride(0),
                                      blocks.data_ptr(), scale_bytes, y.data_ptr(), n, x.size(0),
                                      n, x.size(1), at::get_num_threads(),
                                      static_cast<int>(planes));
    if (status == 4 && planes > 0) {
        status = pagemill_gemv_q4(dtype_code(x), x.data_ptr(), x.stride(0), blocks.data_ptr(),
                                  scale_bytes, y.data_ptr(), n, x.size(0), n, x.size(1),
                                  at::get_num_threads(), static_cast<int>(planes));
    }
    TORCH_CHECK(status != 4, "gemm_q4_amx: no AMX on this machine or in this build");
    TORCH_CHECK(status == 0, "gemm_q4_amx refused its arguments (status ", status, ")");
    return y;
}

at::Tensor gemv_q8(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t n,
                   int64_t planes) {
    check_x("gemv_q8", x_in, blocks_in, n, planes);
    TORCH_CHECK(blocks_in.size(2) == Q8_BLOCK_BYTES, "gemv_q8 tiles are ", Q8_BLOCK_BYTES,
                " bytes per block, got ", blocks_in.size(2));
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor blocks = blocks_in.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int status = pagemill_gemv_q8(dtype_code(x), x.data_ptr(), x.stride(0),
                                        blocks.data_ptr(), y.data_ptr(), n, x.size(0), n,
                                        x.size(1), at::get_num_threads(), static_cast<int>(planes));
    TORCH_CHECK(status == 0, "gemv_q8_cpu refused its arguments (status ", status, ")");
    return y;
}

// gemv_q8's weights on the AMX-BF16 tiles (each block made into bf16, its scales first
// rounded to bf16 with bf16_scales; x rounded to bf16: the dense bf16 product). No native
// fallback: callers check gemv_q8_cpu.gemm_amx_available() before routing to it.
at::Tensor gemm_q8_amx(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t n,
                       bool bf16_scales) {
    check_x("gemm_q8_amx", x_in, blocks_in, n, 1);
    TORCH_CHECK(blocks_in.size(2) == Q8_BLOCK_BYTES, "gemm_q8_amx tiles are ", Q8_BLOCK_BYTES,
                " bytes per block, got ", blocks_in.size(2));
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor blocks = blocks_in.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int status = pagemill_gemm_q8_amx(dtype_code(x), x.data_ptr(), x.stride(0),
                                            blocks.data_ptr(), y.data_ptr(), n, x.size(0), n,
                                            x.size(1), at::get_num_threads(),
                                            bf16_scales ? 1 : 0);
    TORCH_CHECK(status != 4, "gemm_q8_amx: no AMX-BF16 on this machine or in this build");
    TORCH_CHECK(status == 0, "gemm_q8_amx refused its arguments (status ", status, ")");
    return y;
}

}  // namespace

TORCH_LIBRARY(pagemill_native, m) {
    m.def("gemv_q4(Tensor x, Tensor blocks, int n, int planes=2) -> Tensor");
    m.def("gemv_q8(Tensor x, Tensor blocks, int n, int planes=2) -> Tensor");
    m.def("gemm_q4_amx(Tensor x, Tensor blocks, int n, int planes=0) -> Tensor");
    m.def("gemm_q8_amx(Tensor x, Tensor blocks, int n, bool bf16_scales=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagemill_native, CPU, m) {
    m.impl("gemv_q4", &gemv_q4);
    m.impl("gemv_q8", &gemv_q8);
    m.impl("gemm_q4_amx", &gemm_q4_amx);
    m.impl("gemm_q8_amx", &gemm_q8_amx);
}

// ---- gemm_q4_amx_silu_mul: the MLP's gate | up product with silu(gate) * up in its epilogue

extern "C" int pagemill_gemm_q4_amx_silu_mul(int dtype, const void* x, int64_t x_stride,
                                             const void* w, int scale_bytes, void* y,
                                             int64_t y_stride, int64_t m_rows, int64_t n,
                                             int64_t k, int threads);

namespace {

// silu(x Wg^T) * (x Wu^T) [M, n / 2] for a gate | up layer of n outputs (gate rows first),
// the AMX-BF16 product (gemm_q4_amx, planes 0) with the activation applied to its fp32 tiles.
// No native fallback: callers check gemv_q4_cpu.amx_available() and n % 32 == 0.
at::Tensor gemm_q4_amx_silu_mul(const at::Tensor& x_in, const at::Tensor& blocks_in,
                                int64_t n) {
    check_x("gemm_q4_amx_silu_mul", x_in, blocks_in, n, 1);
    TORCH_CHECK(n % (2 * ROWS) == 0, "gemm_q4_amx_silu_mul: N = ", n,
                " is not two halves of whole tiles (a multiple of ", 2 * ROWS, ")");
    const int64_t width = q4_tile_width("gemm_q4_amx_silu_mul", blocks_in);
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const at::Tensor blocks = blocks_in.contiguous();
    at::Tensor y = at::empty({x.size(0), n / 2}, x.options());
    const int status = pagemill_gemm_q4_amx_silu_mul(
        dtype_code(x), x.data_ptr(), x.stride(0), blocks.data_ptr(),
        static_cast<int>((width - Q4_QS_BYTES) / (2 * ROWS)), y.data_ptr(), n / 2, x.size(0), n,
        x.size(1), at::get_num_threads());
    TORCH_CHECK(status != 4, "gemm_q4_amx_silu_mul: no AMX on this machine or in this build");
    TORCH_CHECK(status == 0, "gemm_q4_amx_silu_mul refused its arguments (status ", status, ")");
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagemill_native, m) {
    m.def("gemm_q4_amx_silu_mul(Tensor x, Tensor blocks, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagemill_native, CPU, m) {
    m.impl("gemm_q4_amx_silu_mul", &gemm_q4_amx_silu_mul);
}
