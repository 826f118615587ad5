"""Which adapter a request runs with (vLLM's `LoRARequest`, same names and meaning)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """An adapter by name, id and folder.

    ``lora_int_id`` (>= 1) is the adapter's identity inside the engine, as in vLLM: the
    device slots, the CPU cache and the prefix cache key on it, so one id must always name
    the same weights (the server hands out a fresh id for every adapter it loads).
    ``lora_path`` is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}"
            )
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest.lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest.lora_path must name an adapter folder, got {self.lora_path!r}"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
