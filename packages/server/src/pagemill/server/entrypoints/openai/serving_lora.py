"""LoRA adapters behind the OpenAI API: a request's ``model`` picks its adapter.

The front end owns the adapter names (vLLM's ``--lora-modules name=path``, or loaded at
run time) and hands the engine a `LoRARequest` with a fresh id per adapter: the core keys
its slots, CPU cache and prefix cache on the id, so a name unloaded and loaded again from
another folder never meets the old weights. Unloading only forgets the name here; the
core's copies age out of its LRU caches.

`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true (vLLM's variable) or the server was started
with ``--allow-runtime-lora-updating``, as vLLM: anyone who can reach the API could
otherwise make the server read any folder on its machine.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagemill.runtime.lora import LoRARequest
from pagemill.server.entrypoints.openai.errors import APIError

ENV_RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool, environ: dict[str, str] | None = None) -> bool:
    """The flag, or vLLM's environment variable ("1"/"true", any case)."""
    env = os.environ if environ is None else environ
    return flag or env.get(ENV_RUNTIME_UPDATING, "").strip().lower() in ("1", "true")


def parse_lora_modules(values: Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's ``--lora-modules``: ``name=path`` or JSON ``{"name": ..., "path": ...}``
    (``base_model_name`` is accepted; pagemill serves one base model). Raises ValueError."""
    out: list[tuple[str, str]] = []
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({exc})") from None
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
            if (
                unknown
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise ValueError(
                    f"--lora-modules {value!r}: the JSON form takes "
                    '{"name": str, "path": str, "base_model_name": str (optional)}'
                )
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or JSON")
        if not name or not path:
            raise ValueError(f"--lora-modules {value!r}: the name and the path must be non-empty")
        out.append((name, path))
    return out


class LoRARegistry:
    """Adapter names -> `LoRARequest`s (fresh ids), checked on entry (config and files)."""

    def __init__(self, max_lora_rank: int, reserved: Sequence[str]) -> None:
        self.max_lora_rank = max_lora_rank
        self._reserved = set(reserved)  # the base model's names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> LoRARequest:
        """Register an adapter; ValueError (already there, a base model name, a folder that
        cannot be served)."""
        from pagemill.runtime.lora.peft import read_adapter_config

        if name in self._reserved:
            raise ValueError(f"{name!r} is the base model's name; pick another adapter name")
        read_adapter_config(Path(path), self.max_lora_rank)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            req = LoRARequest(name, next(self._ids), path)
            self._by_name[name] = req
        return req

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, registry: LoRARegistry, protected: Sequence[Any]) -> None:
    """vLLM's runtime adapter routes (call only when runtime updating is allowed)."""

    @app.post("/v1/load_lora_adapter", dependencies=list(protected))
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            registry.add(req.lora_name, req.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=list(protected))
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not registry.remove(req.lora_name):
            raise APIError(
                404,
                f"The lora adapter '{req.lora_name}' cannot be found.",
                param="lora_name",
                code="model_not_found",
            )
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
