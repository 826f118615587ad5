"""Batched LoRA: the CPU path and the Triton shrink/expand (interpreter) against a
per-token reference that gathers each token's own A and B (no sorting, no segments)."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import (
    add_lora,
    add_lora_torch,
    add_lora_triton,
    lora_cpu,
    lora_segments,
    lora_token_runs,
)


def _reference(y, x, a, b, slots, starts):
    """Every token on its own: y + sum over slices of (x A_jᵀ) B_jᵀ of its slot, in fp64."""
    out = y.double().clone()
    r = a.shape[1] // (len(starts) - 1)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for j in range(len(starts) - 1):
            h = x[t].double() @ a[s, j * r : (j + 1) * r].double().t()
            bj = b[s, starts[j] : starts[j + 1], j * r : (j + 1) * r].double()
            out[t, starts[j] : starts[j + 1]] += h @ bj.t()
    return out


def block_diagonal(b, slices, r):
    """Zero B outside each slice's (rows, rank columns) block: the layout's contract."""
    mask = torch.zeros_like(b)
    row = 0
    for j, n in enumerate(slices):
        mask[:, row : row + n, j * r : (j + 1) * r] = 1
        row += n
    return b * mask


def _case(t, k, slices, r, num_slots, dtype=torch.float32, seed=0, base_share=0.3):
    g = torch.Generator().manual_seed(seed)
    out = sum(slices)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, out, generator=g).to(dtype)
    a = (torch.randn(num_slots, len(slices) * r, k, generator=g) / k**0.5).to(dtype)
    b = block_diagonal(torch.randn(num_slots, out, len(slices) * r, generator=g), slices, r)
    b = b.to(dtype)
    slots = torch.randint(0, num_slots, (t,), generator=g)
    slots[torch.rand(t, generator=g) < base_share] = -1
    starts = [0]
    for n in slices:
        starts.append(starts[-1] + n)
    return y, x, a, b, slots, starts


def test_segments_sort_tokens_by_slot_and_leave_base_tokens_out() -> None:
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 1])
    sorted_ids, seg = lora_segments(slots, 4)
    assert seg.tolist() == [0, 2, 3, 5, 5]
    assert sorted_ids[:5].tolist() == [2, 4, 6, 0, 3]  # stable within a slot
    assert sorted(sorted_ids[5:].tolist()) == [1, 5]


@pytest.mark.parametrize(
    ("t", "k", "slices", "r", "slots"),
    [(1, 32, (48,), 8, 2), (37, 64, (64, 16, 16), 16, 3), (130, 48, (40, 40), 4, 4)],
)
def test_torch_path_matches_per_token_reference(t, k, slices, r, slots) -> None:
    y, x, a, b, token_slots, starts = _case(t, k, slices, r, slots)
    want = _reference(y, x, a, b, token_slots, starts)
    sorted_ids, seg = lora_segments(token_slots, slots)
    add_lora_torch(y, x, a, b, sorted_ids, seg, torch.tensor(starts))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_token_runs_find_each_slots_first_token_and_whether_runs_are_contiguous() -> None:
    # base tokens may sit between runs; a slot whose tokens are split is not one run
    assert lora_token_runs(torch.tensor([1, 1, -1, 0, 0, 0, -1]), 3).tolist() == [3, 0, 0, 1]
    assert lora_token_runs(torch.tensor([1, 0, 1]), 2)[-1].item() == 0
    assert lora_token_runs(torch.tensor([-1, -1]), 2).tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    ("runs", "k", "slices", "r", "dtype"),
    [
        ([(1, 16), (-1, 3), (0, 5), (2, 1)], 64, (64, 16, 16), 16, torch.float32),
        ([(0, 7), (1, 9)], 48, (40, 40), 8, torch.float32),
        ([(2, 4), (-1, 2), (0, 6)], 32, (48,), 16, torch.bfloat16),
    ],
)
def test_contiguous_runs_are_added_in_place(runs, k, slices, r, dtype) -> None:
    """The in-place path (each slot's tokens one run in token order) against the reference,
    and against the gather path on the same operands."""
    token_slots = torch.cat([torch.full((n,), s) for s, n in runs])
    t = token_slots.numel()
    y, x, a, b, _, starts = _case(t, k, slices, r, 3, dtype=dtype, seed=t)
    want = _reference(y, x, a, b, token_slots, starts)
    sorted_ids, seg = lora_segments(token_slots, 3)
    firsts = lora_token_runs(token_slots, 3)
    assert firsts[-1].item() == 1
    gathered = y.clone()
    add_lora_torch(gathered, x, a, b, sorted_ids, seg, torch.tensor(starts))
    add_lora_torch(y, x, a, b, sorted_ids, seg, torch.tensor(starts), firsts)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), gathered.double(), rtol=tol, atol=tol)


def test_contiguous_runs_with_fp32_stacks_under_a_bf16_model() -> None:
    """The runtime's CPU layout: bf16 activations, fp32 adapter stacks."""
    token_slots = torch.tensor([1] * 5 + [-1] * 3 + [0] * 7 + [2] * 2 + [-1])
    y, x, a, b, _, starts = _case(token_slots.numel(), 64, (64, 32), 16, 3, seed=5)
    y, x = y.bfloat16(), x.bfloat16()
    want = _reference(y, x, a, b, token_slots, starts)
    sorted_ids, seg = lora_segments(token_slots, 3)
    before = y.clone()
    add_lora_torch(
        y, x, a, b, sorted_ids, seg, torch.tensor(starts), lora_token_runs(token_slots, 3)
    )
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])


def test_base_only_step_changes_nothing() -> None:
    y, x, a, b, _, starts = _case(9, 16, (24,), 4, 2)
    before = y.clone()
    sorted_ids, seg = lora_segments(torch.full((9,), -1), 2)
    add_lora(y, x, a, b, sorted_ids, seg, torch.tensor(starts))
    assert torch.equal(y, before)


def test_shapes_that_disagree_are_refused() -> None:
    y, x, a, b, slots, starts = _case(4, 16, (24,), 4, 2)
    sorted_ids, seg = lora_segments(slots, 2)
    with pytest.raises(ValueError, match="shapes disagree"):
        add_lora_torch(y[:, :20], x, a, b, sorted_ids, seg, torch.tensor(starts))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    ("t", "k", "slices", "r", "slots", "dtype"),
    [
        (3, 32, (48,), 8, 2, torch.float32),
        (37, 64, (64, 16, 16), 16, 3, torch.float32),
        (70, 48, (40, 72), 4, 4, torch.float32),
        (20, 32, (32, 32), 16, 2, torch.bfloat16),
        (9, 32, (48, 16), 80, 2, torch.float32),  # several rank tiles (shrink and expand)
    ],
)
def test_triton_matches_per_token_reference(t, k, slices, r, slots, dtype) -> None:
    y, x, a, b, token_slots, starts = _case(t, k, slices, r, slots, dtype=dtype, seed=t)
    want = _reference(y, x, a, b, token_slots, starts)
    sorted_ids, seg = lora_segments(token_slots, slots)
    add_lora_triton(y, x, a, b, sorted_ids, seg, torch.tensor(starts, dtype=torch.int32))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


def test_custom_op_updates_y_in_a_compiled_graph() -> None:
    y, x, a, b, slots, starts = _case(11, 32, (24, 8), 4, 3)
    want = _reference(y, x, a, b, slots, starts)
    sorted_ids, seg = lora_segments(slots, 3)
    st = torch.tensor(starts)
    firsts = lora_token_runs(slots, 3)

    def f(y, x):
        y = y * 1.0
        torch.ops.pagemill.add_lora(y, x, a, b, sorted_ids, seg, st, 0, firsts)
        return y

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(y, x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---- the native CPU kernel (kernels/csrc/lora_cpu.cpp) ------------------------------------


@pytest.fixture
def native():
    lib = lora_cpu.load()
    if lib is None:
        pytest.skip("the native CPU LoRA kernel could not be built here")
    return lib


def _transposed(b):
    """The runtime's CPU layout of B: a [L, out, S*R] view of a contiguous [L, S*R, out]."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize(
    ("t", "k", "slices", "r", "slots", "x_dtype", "y_dtype", "base_share"),
    [
        (1, 32, (48,), 8, 2, torch.float32, torch.float32, 0.0),
        (37, 64, (64, 16, 16), 16, 3, torch.float32, torch.float32, 0.3),
        (130, 48, (40, 72), 4, 4, torch.bfloat16, torch.bfloat16, 0.3),
        (29, 35, (7, 33), 3, 2, torch.bfloat16, torch.float32, 0.5),  # odd K, rank, widths
        (70, 100, (96,), 5, 3, torch.float32, torch.bfloat16, 0.1),
        (6, 16, (16,), 2, 4, torch.float32, torch.float32, 1.0),  # base tokens only
    ],
)
def test_native_kernel_matches_per_token_reference(
    native, t, k, slices, r, slots, x_dtype, y_dtype, base_share
) -> None:
    """Slots interleaved in token order (no runs), several tasks per slot and a last partial
    one, vector tails in K and in each slice; base rows left bit for bit."""
    y, x, a, b, token_slots, starts = _case(t, k, slices, r, slots, seed=t, base_share=base_share)
    y, x = y.to(y_dtype), x.to(x_dtype)
    want = _reference(y, x, a, b, token_slots, starts)
    sorted_ids, seg = lora_segments(token_slots, slots)
    st = torch.tensor(starts, dtype=torch.int32)
    bt = _transposed(b)
    assert lora_cpu.supports(y, x, a, bt, sorted_ids, seg, st)
    before = y.clone()
    lora_cpu.add_lora_native(native, y, x, a, bt, sorted_ids, seg, st, len(slices), r)
    tol = 2e-2 if torch.bfloat16 in (x_dtype, y_dtype) else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])


def test_add_lora_runs_the_native_kernel_on_the_runtime_layout(native, monkeypatch) -> None:
    y, x, a, b, slots, starts = _case(40, 64, (64, 32), 8, 3, seed=3)
    y, x = y.bfloat16(), x.bfloat16()
    want = _reference(y, x, a, b, slots, starts)
    sorted_ids, seg = lora_segments(slots, 3)
    st = torch.tensor(starts, dtype=torch.int32)
    calls = []
    real = lora_cpu.add_lora_native
    monkeypatch.setattr(lora_cpu, "add_lora_native", lambda *args: calls.append(1) or real(*args))
    add_lora(y, x, a, _transposed(b), sorted_ids, seg, st)
    assert calls == [1]
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)


def test_native_kernel_refuses_a_mapping_outside_x_and_writes_nothing(native) -> None:
    y, x, a, b, slots, starts = _case(8, 32, (24,), 4, 2, base_share=0.0)
    sorted_ids, seg = lora_segments(slots, 2)
    sorted_ids[0] = 8  # one row past the end
    before = y.clone()
    with pytest.raises(RuntimeError, match="refused"):
        lora_cpu.add_lora_native(
            native, y, x, a, _transposed(b), sorted_ids, seg, torch.tensor(starts).int(), 1, 4
        )
    assert torch.equal(y, before)


def test_native_kernel_in_a_compiled_graph(native) -> None:
    y, x, a, b, slots, starts = _case(19, 32, (24, 8), 4, 3)
    want = _reference(y, x, a, b, slots, starts)
    sorted_ids, seg = lora_segments(slots, 3)
    st = torch.tensor(starts, dtype=torch.int32)
    bt = _transposed(b)

    def f(y, x):
        y = y * 1.0
        torch.ops.pagemill.add_lora(y, x, a, bt, sorted_ids, seg, st, 0, None)
        return y

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(y, x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
