"""What every attention layer needs to know about the flattened batch of one step.

Built once per step by the model runner and shared by all layers, so per-layer work is
only the kernels themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Layout of the super-sequence of one step (all tensors on the model's device).

    `query_start_loc` [S+1] int32: where each request's tokens start in the flat batch.
    `seq_lens` [S] int32: each request's context length including this step's tokens.
    `block_tables` [S, max_blocks] int32: physical block ids, padded (padding never read).
    `slot_mapping` [T] int64: KV-cache slot of each token (-1 = do not write).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_seq_len: int
