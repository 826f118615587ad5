"""The Triton kernels themselves: one module per op, imported only when a kernel first runs.

Nothing outside this subpackage imports `triton`. The op modules reach these kernels
through `pagemill.kernels._dispatch.lazy_kernels`, so `import pagemill.kernels` works (and
the torch paths run) where Triton is not installed — macOS, Windows, CPU-only Linux — and
costs no Triton import where it is. `@triton.jit` reads ``TRITON_INTERPRET`` when a module
here is first imported, i.e. at the first Triton call, not at ``import pagemill.kernels``.

`MODULES` lists every module of kernels; the ahead-of-time compilation test compiles every
kernel they define (tests/test_aot_compile.py).
"""

MODULES = (
    "pagemill.kernels._triton.activation",
    "pagemill.kernels._triton.attention",
    "pagemill.kernels._triton.int4_gemm",
    "pagemill.kernels._triton.kv_cache",
    "pagemill.kernels._triton.lora",
    "pagemill.kernels._triton.rms_norm",
    "pagemill.kernels._triton.rotary",
)
