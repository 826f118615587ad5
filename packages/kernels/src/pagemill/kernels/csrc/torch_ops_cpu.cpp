// The CPU kernels' C++ torch operators (torch.ops.pagemill_native.*) as one translation unit:
// the GEMV operators of gemv_ops_cpu.cpp and the decode attention / KV write operators of
// paged_ops_cpu.cpp, and their C entry points for inductor's C++ wrapper (aoti_shims_cpu.cpp).
// Parsing torch's headers is most of compiling either file, so one unit
// parses them once on a machine's first start instead of twice. Built by
// pagemill.kernels.cpu_native.build_torch_ops, linked with the kernels' own objects.
#include "gemv_ops_cpu.cpp"
#include "paged_ops_cpu.cpp"
#include "aoti_shims_cpu.cpp"
