"""Adapters in device slots, evicted least-recently-used to a CPU cache, and the per-step
token-to-slot mapping.

`LoRAManager` attaches a `LoRALayer` to every q|k|v, o, gate|up and down projection of the
model once, at start-up (the stacks are sized by ``max_loras`` and ``max_lora_rank``, so
adapters come and go without touching the graph). Each step the model runner hands it the
adapter id of every scheduled request (`prepare_step`): adapters of the step that are not
in a slot are copied in — from the CPU cache, or read from their folder when they were
evicted from it too — over the least recently used slot no request of this step needs;
then the tokens' slots go to the shared `LoRAStepMapping`. The scheduler admits no more
distinct adapters into the running set than there are slots (`SchedulerConfig.max_loras`),
so a step always fits.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagemill.runtime.lora.layers import LoRALayer, LoRAStepMapping
from pagemill.runtime.lora.peft import TARGETS, LoRAAdapter, LoRAError, load_peft_adapter
from pagemill.runtime.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM, LlamaMLP

        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"LoRA is not supported for {type(model).__name__}")
        if getattr(model, "tp", None) is not None:
            raise ValueError("LoRA with tensor_parallel_size > 1 is not supported yet")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        # On CPU the stacks stay fp32 under a bf16 model: the adapter GEMMs are small, and
        # small bf16 GEMMs cost several times their fp32 twins there (kernels.lora).
        self.dtype = torch.float32 if device.type == "cpu" else dtype
        self.device = device
        self.mapping = LoRAStepMapping(max_loras, max_num_tokens, device)
        # (layer, our projection) -> its LoRALayer; (layer, PEFT module) -> (in, out).
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        c = model.config
        for i, layer in enumerate(model.decoder_layers()):
            attn = layer.self_attn
            projections = [
                (
                    "qkv_proj",
                    attn.qkv_proj,
                    [("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)],
                ),
                ("o_proj", attn.o_proj, [("o_proj", c.hidden_size)]),
            ]
            if isinstance(layer.mlp, LlamaMLP):  # a sparse (MoE) block has no dense MLP
                inter = c.intermediate_size
                mlp = layer.mlp
                projections += [
                    ("gate_up_proj", mlp.gate_up_proj, [("gate_proj", inter), ("up_proj", inter)]),
                    ("down_proj", mlp.down_proj, [("down_proj", c.hidden_size)]),
                ]
            for ours, linear, slices in projections:
                lora = LoRALayer(
                    linear.in_features,
                    [n for _, n in slices],
                    max_loras,
                    max_lora_rank,
                    self.mapping,
                    self.dtype,
                    device,
                )
                linear.lora = lora
                self.layers[(i, ours)] = lora
                for peft_name, n in slices:
                    self.shapes[(i, peft_name)] = (linear.in_features, n)
        # Known adapters (id -> request), the CPU cache (LRU first) and the slots (LRU first).
        self.requests: dict[int, LoRARequest] = {}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(max_loras))
        self.last_load_s = 0.0

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot stacks."""
        return sum(la.lora_a.nbytes + la.lora_b.nbytes for la in self.layers.values())

    # ---- adapters ------------------------------------------------------------------------

    def _read(self, req: LoRARequest) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = load_peft_adapter(
            req.lora_name,
            req.lora_int_id,
            req.lora_path,
            self.shapes,
            self.max_lora_rank,
            self.dtype,
        )
        self.last_load_s = time.perf_counter() - start
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %d projections) read from %s in %.3f s",
            req.lora_name,
            req.lora_int_id,
            adapter.rank,
            len(adapter.weights),
            req.lora_path,
            self.last_load_s,
        )
        return adapter

    def add_adapter(self, req: LoRARequest) -> None:
        """Make an adapter known, read and checked now (raises `LoRAError` if it cannot be
        served); an id seen before must name the same folder."""
        known = self.requests.get(req.lora_int_id)
        if known is not None:
            if known.lora_path != req.lora_path:
                raise LoRAError(
                    f"LoRA id {req.lora_int_id} is {known.lora_name!r} ({known.lora_path}); "
                    f"it cannot also name {req.lora_path}"
                )
            return
        adapter = self._read(req)
        self.requests[req.lora_int_id] = req
        self._cache(adapter)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot and CPU copy); False if it was not known."""
        self.cpu.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return self.requests.pop(lora_int_id, None) is not None

    def list_adapters(self) -> list[int]:
        return list(self.requests)

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.lora_int_id] = adapter
        self.cpu.move_to_end(adapter.lora_int_id)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _host_copy(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self.cpu.get(lora_int_id)
        if adapter is None:  # evicted from the CPU cache too: read it again
            req = self.requests.get(lora_int_id)
            if req is None:
                raise LoRAError(f"LoRA id {lora_int_id} was never added (or was removed)")
            adapter = self._read(req)
        self._cache(adapter)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        grouped: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            ours, j = TARGETS[module]
            grouped.setdefault((layer, ours), {})[j] = (
                a.to(self.device, non_blocking=True),
                b.to(self.device, non_blocking=True),
            )
        for key, lora in self.layers.items():
            lora.set_slot(slot, grouped.get(key, {}))

    def activate(self, ids: Sequence[int]) -> dict[int, int]:
        """Slots for the adapters of a step (ids >= 1), loading the missing ones."""
        wanted = list(dict.fromkeys(i for i in ids if i > 0))
        if len(wanted) > self.max_loras:
            raise ValueError(
                f"a step uses {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}"
            )
        for lid in wanted:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            adapter = self._host_copy(lid)
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next(v for v in self.slot_of if v not in wanted)
                slot = self.slot_of.pop(victim)
            self._load_into(slot, adapter)
            self.slot_of[lid] = slot
        return {lid: self.slot_of[lid] for lid in wanted}

    # ---- the step ------------------------------------------------------------------------

    def prepare_step(self, lora_ids: Sequence[int], num_tokens: np.ndarray) -> None:
        """Slots in, and the mapping of a step whose request i has ``num_tokens[i]`` tokens."""
        slots = self.activate(lora_ids)
        per_request = np.fromiter(
            (slots.get(i, -1) for i in lora_ids), dtype=np.int64, count=len(lora_ids)
        )
        self.mapping.set(torch.from_numpy(np.repeat(per_request, num_tokens)))
