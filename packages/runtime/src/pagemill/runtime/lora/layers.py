"""The adapter stacks one projection holds, and the step's token-to-slot mapping.

A `Linear` with ``lora`` set adds every token's adapter delta after its own matmul,
whatever its weight format (dense, int8/int4 packed, GGUF rows): the adapter stays dense.
The stacks are plain tensor attributes (not parameters or buffers) written in place when an
adapter enters a slot, and the mapping's tensors are written in place every step: a
compiled graph reads them as inputs through the opaque ``pagemill::add_lora`` call, so
neither is frozen into it.
"""

from __future__ import annotations

import torch

from pagemill.kernels import add_lora, lora_segments, lora_token_runs


class LoRAStepMapping:
    """The step's tokens sorted by adapter slot (see `pagemill.kernels.lora_segments`),
    shared by every LoRA layer of the model; sized for the longest step."""

    def __init__(self, max_loras: int, max_num_tokens: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.sorted_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.seg_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        # Where each slot's run starts in token order, if every run is contiguous (the torch
        # CPU path then works on x's and y's rows in place); unused by the native CPU kernel
        # (it reads rows through sorted_ids) and the GPU kernels.
        self.token_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        self.in_place_runs = True  # False: always the gather path (benchmarks/lora.py A/B)

    def set(self, token_slots: torch.Tensor) -> None:
        """[T] slot per token (-1: the base model), on the host."""
        sorted_ids, seg = lora_segments(token_slots, self.max_loras)
        n = sorted_ids.numel()
        if n > self.sorted_ids.numel():
            raise ValueError(
                f"a step of {n} tokens exceeds the LoRA mapping's {self.sorted_ids.numel()}"
            )
        self.sorted_ids[:n].copy_(sorted_ids, non_blocking=True)
        self.seg_starts.copy_(seg, non_blocking=True)
        if self.token_starts.device.type == "cpu":
            if self.in_place_runs:
                self.token_starts.copy_(lora_token_runs(token_slots, self.max_loras))
            else:
                self.token_starts.zero_()


class LoRALayer:
    """One projection's adapter slots: ``lora_a`` [max_loras, S * R, in] and ``lora_b``
    [max_loras, out, S * R] (block-diagonal, see `pagemill.kernels.lora`) over its S slices
    (q|k|v, gate|up, or one), zero where empty."""

    def __init__(
        self,
        in_features: int,
        slice_sizes: list[int],
        max_loras: int,
        max_rank: int,
        mapping: LoRAStepMapping,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.in_features = in_features
        self.slice_sizes = list(slice_sizes)
        self.max_rank = max_rank
        self.mapping = mapping
        out = sum(slice_sizes)
        starts = [0]
        for n in slice_sizes:
            starts.append(starts[-1] + n)
        self.starts = starts
        s = len(slice_sizes)
        self.lora_a = torch.zeros(max_loras, s * max_rank, in_features, dtype=dtype, device=device)
        if device.type == "cpu":
            # B stored transposed: the native CPU kernel (`pagemill.kernels.lora_cpu`) reads
            # its rows along the output; the [L, out, S*R] view keeps the op's contract.
            b_t = torch.zeros(max_loras, s * max_rank, out, dtype=dtype, device=device)
            self.lora_b = b_t.transpose(1, 2)
        else:
            self.lora_b = torch.zeros(max_loras, out, s * max_rank, dtype=dtype, device=device)
        self.slice_starts = torch.tensor(starts, dtype=torch.int32, device=device)

    @torch.no_grad()
    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's slices (slice index -> (A [r, in], B [n, r])) into ``slot``;
        slices it does not adapt stay zero."""
        r_max = self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, (a, b) in pieces.items():
            r = a.shape[0]
            self.lora_a[slot, j * r_max : j * r_max + r].copy_(a)
            cols = slice(j * r_max, j * r_max + r)
            self.lora_b[slot, self.starts[j] : self.starts[j + 1], cols].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each token's adapter delta (y is updated in place and returned)."""
        m = self.mapping
        ids = m.sorted_ids[: x.shape[0]]
        if torch.compiler.is_compiling():
            torch.ops.pagemill.add_lora(
                y,
                x,
                self.lora_a,
                self.lora_b,
                ids,
                m.seg_starts,
                self.slice_starts,
                max(self.slice_sizes),
                m.token_starts,
            )
        else:
            add_lora(
                y,
                x,
                self.lora_a,
                self.lora_b,
                ids,
                m.seg_starts,
                self.slice_starts,
                max(self.slice_sizes),
                m.token_starts,
            )
        return y
