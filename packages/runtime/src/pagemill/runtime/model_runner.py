"""Turns a `SchedulerOutput` into one forward pass over the flattened batch.

Every scheduled token of every request is laid end to end (no padding): prefill chunks and
single decode tokens mix freely. Per-request metadata is built from small arrays and the
per-token arrays (positions, slot mapping) are derived from them with vectorised torch
ops, so the host cost of a step grows with the number of requests, not of tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from pagemill.scheduler import ScheduledRequest, SchedulerOutput

from .attention_metadata import AttentionMetadata
from .config import ModelConfig
from .kv_cache import KVCache
from .models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Logits of the rows that sample this step, in the order of `req_ids`."""

    req_ids: list[str]
    logits: torch.Tensor  # [len(req_ids), vocab], model dtype


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    sample_req_ids: list[str]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.kv_cache: KVCache | None = None
        # Host-side staging for the block table: filled row by row, copied once per step.
        self._block_table_np = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._pin = device.type == "cuda"
        # On CPU the tensors are used where they are built; tests may force packing on.
        self.pack_inputs = device.type != "cpu"
        self._staging: torch.Tensor | None = None
        self._copy_done: torch.cuda.Event | None = None

    # ---- KV cache ------------------------------------------------------------------------

    def init_kv_cache(self, num_blocks: int) -> KVCache:
        self.kv_cache = KVCache(self.model_config, num_blocks, self.block_size, self.dtype, self.device)
        self.model.bind_kv_caches(self.kv_cache.caches)
        return self.kv_cache

    def dummy_batch(self) -> tuple[SchedulerOutput, int]:
        """The heaviest step the limits allow, and the KV blocks it needs.

        `max_num_batched_tokens` tokens spread over as many sequences as may share a step
        (so the logits rows peak too), none longer than max_model_len.
        """
        # A step can never hold more than max_num_seqs full-length sequences.
        tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        num_seqs = max(math.ceil(tokens / self.max_model_len), min(self.max_num_seqs, tokens))
        per_seq = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
        sched, next_block = [], 0
        for i, n in enumerate(per_seq):
            nb = math.ceil(n / self.block_size)
            blocks = list(range(next_block, next_block + nb))
            sched.append(ScheduledRequest(f"profile-{i}", [0] * n, 0, n, blocks, True))
            next_block += nb
        return SchedulerOutput(scheduled=sched, total_num_scheduled_tokens=tokens), next_block

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Extra device memory (bytes) that the heaviest possible step needs (CUDA only).

        Runs `dummy_batch()` against a throwaway KV cache just large enough for it and
        reads the allocator's peak above what was allocated before (the weights).
        """
        batch, blocks_needed = self.dummy_batch()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        scratch = KVCache(self.model_config, blocks_needed, self.block_size, self.dtype, self.device)
        # Only a torch-allocated scratch cache shows up in torch's counters.
        scratch_bytes = scratch.nbytes if scratch.storage is None else 0
        self.model.bind_kv_caches(scratch.caches)
        self.execute_model(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch_bytes
        self.model.unbind_kv_caches()
        del scratch
        torch.cuda.empty_cache()
        return max(0, peak)

    # ---- batch ---------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} scheduled requests exceed max_num_seqs={self.max_num_seqs}")
        flat_ids: list[int] = []
        num_tokens = np.empty(num_seqs, dtype=np.int64)
        start_pos = np.empty(num_seqs, dtype=np.int64)
        table = self._block_table_np
        width = 1
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        for i, s in enumerate(scheduled):
            flat_ids.extend(s.token_ids)
            num_tokens[i] = s.num_tokens
            start_pos[i] = s.start_pos
            nb = len(s.block_ids)
            if nb > self.max_blocks_per_seq:
                raise ValueError(f"request {s.request_id} has {nb} blocks, more than max_model_len allows")
            table[i, :nb] = s.block_ids
            width = max(width, nb)
            if s.sample:
                sample_rows.append(i)
                sample_req_ids.append(s.request_id)
        total = len(flat_ids)
        if total != int(num_tokens.sum()):
            raise ValueError("ScheduledRequest.token_ids lengths disagree with num_tokens")

        num_tokens_t = torch.from_numpy(num_tokens)
        start_t = torch.from_numpy(start_pos)
        cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(num_tokens_t, 0, out=cu[1:])
        seq_lens = start_t + num_tokens_t
        # Token k of request s sits at position start_pos[s] + (k - cu[s]).
        req_of_token = torch.repeat_interleave(torch.arange(num_seqs), num_tokens_t, output_size=total)
        positions = torch.arange(total, dtype=torch.int64) + (start_t - cu[:-1]).repeat_interleave(
            num_tokens_t, output_size=total
        )
        block_tables = torch.from_numpy(table[:num_seqs, :width].copy())
        block_idx = torch.div(positions, self.block_size, rounding_mode="floor")
        if total and int(block_idx.max()) >= width:
            raise ValueError("a scheduled token lies beyond its request's block table")
        slot_mapping = block_tables[req_of_token, block_idx].to(torch.int64) * self.block_size + (
            positions % self.block_size
        )
        sample_indices = cu[1:][torch.tensor(sample_rows, dtype=torch.int64)] - 1

        input_ids = torch.tensor(flat_ids, dtype=torch.int64)
        (input_ids, positions, slot_mapping, sample_indices, cu, seq_lens, block_tables) = self._to_device(
            [input_ids, positions, slot_mapping, sample_indices, cu, seq_lens, block_tables]
        )
        meta = AttentionMetadata(
            query_start_loc=cu.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables.to(torch.int32),
            slot_mapping=slot_mapping,
            num_tokens=total,
            max_query_len=int(num_tokens.max()) if num_seqs else 0,
            max_seq_len=int((start_pos + num_tokens).max()) if num_seqs else 0,
        )
        return PreparedBatch(input_ids, positions, meta, sample_indices, sample_req_ids)

    def _to_device(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move the step's index tensors to the device in one copy.

        Many tiny host-to-device copies cost more than the data: everything is packed into
        one reused pinned int32 buffer (every index here fits in int32), copied once, and
        split back into views on the device.
        """
        if not self.pack_inputs:
            return pieces
        sizes = [p.numel() for p in pieces]
        n = sum(sizes)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy may still read the buffer
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * (self._staging.numel() if self._staging is not None else 0)),
                                        dtype=torch.int32, pin_memory=self._pin)
        buf = self._staging[:n]
        torch.cat([p.reshape(-1).to(torch.int32) for p in pieces], out=buf)
        moved = buf.to(self.device, non_blocking=True)
        if self._pin:
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return [t.view(p.shape) for t, p in zip(moved.split(sizes), pieces)]

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens; logits only at the last token of each sampling request."""
        if not out.scheduled:
            return ModelRunnerOutput([], torch.empty(0, self.model_config.vocab_size, dtype=self.dtype, device=self.device))
        batch = self.prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        if not batch.sample_req_ids:
            logits = hidden.new_empty(0, self.model_config.vocab_size)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, batch.sample_indices))
        return ModelRunnerOutput(batch.sample_req_ids, logits)
