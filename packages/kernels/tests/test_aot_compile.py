"""Every Triton kernel compiles for sm_80 and sm_90 — on a machine without a GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 | 90, 32))` lowers a kernel
all the way to a cubin with the ptxas that ships inside the triton wheel; no driver and no
device are involved. `aot_compile.py` (beside this file) records what the launchers launch
for each served configuration — the real planners and launchers run, `JITFunction.run` is
swapped for a recorder — and compiles each launch as Triton's launcher would specialise it.
So the configurations are the code's own: a new tile size or a new kernel is compiled here
the day it is written, and a kernel that no longer compiles fails CI.

Why a subprocess: the root conftest sets ``TRITON_INTERPRET=1`` on machines without
``nvidia-smi``, and ``@triton.jit`` reads it when a kernel module is imported, turning every
kernel of this process into an interpreter function, which cannot be compiled for a GPU
(and whose nested kernel calls resolve to interpreter functions too). A fresh interpreter
without the variable imports the kernels as real JITFunctions. Compiled kernels land in
Triton's own cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``; keyed by source,
options and target, so a stale entry is never reused): after a first run of ~25 s the
default grid costs about the subprocess's start-up, the full grid (~460 compiles, ~5 min on
two cores when cold) about 20 s.

Checks, per kernel and target: it compiles; its shared memory (dynamic + static) fits the
target's per-block opt-in limit (sm_80: 163 KiB, sm_90: 227 KiB); it does not spill
registers (stack bytes in the cubin; Triton kernels have no local arrays) — the planner's
tiles were chosen so that none does, fp32 (dots on CUDA cores) included. The default run
compiles a representative subset (Llama-3.1-8B's and SmolLM2's layouts, decode, split decode
and prefill, and every other kernel once); the
full grid — fp16/bf16/fp32 x head sizes 64/128/256 x GQA groups 1/2/3/4/7/8 x decode/split/
prefill, every split-count bucket of the merge kernel, the small kernels for each served
model — is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagemill.kernels._dispatch import triton_available

HARNESS = Path(__file__).with_name("aot_compile.py")

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.fixture(scope="module", params=["default", pytest.param("full", marks=pytest.mark.slow)])
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    grid = request.param
    out = tmp_path_factory.mktemp("aot") / f"{grid}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = "2" if grid == "full" else "1"
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--grid", grid, "--jobs", jobs, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if not out.exists():
        pytest.fail(f"the AOT harness did not run (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    data = json.loads(out.read_text())
    data["log"] = proc.stderr
    return data


def _describe(r: dict) -> str:
    return f"sm_{r['capability']} {r['kernel']} {json.dumps(r['meta'])} num_warps={r['num_warps']}"


def test_every_kernel_compiles(report: dict) -> None:
    failed = [f"{_describe(r)}\n  {r['error']}" for r in report["results"] if not r["ok"]]
    assert not failed, "kernels that do not compile:\n" + "\n".join(failed)
    assert {r["capability"] for r in report["results"]} == {80, 90}


def test_every_kernel_is_compiled(report: dict) -> None:
    """Every launchable kernel of pagemill.kernels._triton is among the compiled ones."""
    missing = set(report["defined_kernels"]) - set(report["launched_kernels"])
    assert not missing, f"kernels no configuration launches (add them to aot_compile.py): {missing}"


def test_shared_memory_fits(report: dict) -> None:
    over = [
        f"{_describe(r)}: {r['shared']} B > {r['shared_limit']} B"
        for r in report["results"]
        if r["ok"] and r["shared"] > r["shared_limit"]
    ]
    assert not over, "shared memory over the target's limit:\n" + "\n".join(over)


def test_no_register_spills(report: dict) -> None:
    spills = [
        f"{_describe(r)}: {r['regs']} registers, {r['spill_bytes']} B spilled"
        for r in report["results"]
        if r["ok"] and r["spill_bytes"]
    ]
    assert not spills, "kernels that spill registers:\n" + "\n".join(spills)


def test_main_configs_are_in_the_default_grid(report: dict) -> None:
    """The decode and prefill configurations of the Llama-3.1-8B layout in bf16 are compiled
    (and so checked above) in every run, not only in the slow one."""
    main = [
        r
        for r in report["results"]
        if r["kernel"] == "paged_attention_kernel"
        and r["meta"].get("HEAD_DIM") == 128
        and r["meta"].get("GROUP") == 4
        and not r["meta"].get("DOT_FP32")
    ]
    kinds = {(r["capability"], r["meta"]["BLOCK_Q"] > 1, r["meta"]["SPLIT"]) for r in main}
    assert kinds >= {
        (c, prefill, split)
        for c in (80, 90)
        for prefill, split in ((False, False), (False, True), (True, False))
    }
