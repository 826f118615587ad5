"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

Rank 0 — the engine process — keeps the scheduler, the block pool and the sampler; each
step it broadcasts the step's token layout (`model_runner.StepBatch`), every rank runs its
shard of the model over it (all-reducing after each row-parallel projection and the
embedding), and the vocab-parallel logits are gathered on rank 0, which samples.

* `parallel_state` — the group object handed to everything that communicates;
* `sharding` — which heads, MLP columns and vocabulary rows a rank holds;
* `parallel_layers` — row-parallel linear, vocab-parallel embedding;
* `launcher` — rank 0's side: start (or join) the other ranks, keep them, stop them;
* `worker` — the other ranks' side: load a shard, then run whatever step rank 0 sends.
"""

from pagemill.runtime.distributed.parallel_state import TensorParallelError, TensorParallelGroup
from pagemill.runtime.distributed.sharding import ShardLayout, check_tensor_parallel

__all__ = ["ShardLayout", "TensorParallelError", "TensorParallelGroup", "check_tensor_parallel"]
