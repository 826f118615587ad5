"""pagemill.kernels imports and runs its torch paths where Triton is not installed.

Triton exists for Linux only; a macOS or Windows user gets pagemill without it. The test
simulates that in a fresh interpreter: a meta-path finder placed first refuses ``triton``
and its submodules (exactly what ``import triton`` meets when it is not installed), then
the package is imported and every op runs through its dispatching name and its torch name.
Nothing may import Triton on the way, and a ``*_triton`` call says what is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, NoTriton())

    import torch

    import pagemill.kernels as K
    import pagemill.kernels.ops  # the custom ops for compiled graphs
    from pagemill.kernels._dispatch import triton_available

    assert not triton_available()
    torch.manual_seed(0)
    T, H, KVH, D, B = 5, 4, 2, 32, 16
    x, r, w = torch.randn(T, 64), torch.randn(T, 64), torch.randn(64)
    y, s = K.rms_norm(x, w, 1e-5, r)
    assert torch.equal(y, K.rms_norm_torch(x, w, 1e-5, r)[0])
    assert K.silu_and_mul(torch.randn(T, 128)).shape == (T, 64)
    cos_sin = K.rope_cos_sin(D, 64, 10000.0)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    positions = torch.arange(T)
    q, k = K.apply_rotary(positions, q, k, cos_sin)
    k_cache, v_cache = torch.zeros(4, B, KVH, D), torch.zeros(4, B, KVH, D)
    K.write_kv_cache(k, v, k_cache, v_cache, 2 * B + positions)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, T], dtype=torch.int32)
    lens = torch.tensor([T], dtype=torch.int32)
    plan = K.plan_attention(qsl, lens, tables, k_cache_shape=tuple(k_cache.shape), num_heads=H,
                            dtype=q.dtype)
    assert plan.backend == "torch"
    out = K.paged_attention(q, k_cache, v_cache, tables, qsl, lens, D**-0.5, plan=plan)
    ref = K.paged_attention_torch(q, k_cache, v_cache, tables, qsl, lens, D**-0.5)
    assert torch.equal(out, ref) and bool(torch.isfinite(out).all())

    # Asking for a Triton kernel explicitly (the interpreter lets CPU tensors through).
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        K.rms_norm_triton(x, w, 1e-5)
    except ImportError as e:
        assert "triton" in str(e) and "torch paths" in str(e), e
    else:
        raise AssertionError("rms_norm_triton ran without triton")
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("ok")
    """
)


def test_kernels_import_and_run_without_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_importing_kernels_does_not_import_triton() -> None:
    """Even where Triton is installed, it is imported at the first launch, not at import."""
    script = (
        "import sys, pagemill.kernels, pagemill.kernels.ops; "
        "print(any(m == 'triton' or m.startswith('triton.') for m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "False"
