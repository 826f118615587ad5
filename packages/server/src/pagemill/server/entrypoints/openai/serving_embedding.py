"""POST /v1/embeddings in OpenAI's shape (with vLLM's extras).

Each input becomes one pooling request (`PoolingParams`) in the same engine, scheduled and
batched beside the generation requests; the vectors come back in input order, as floats or
as base64 of little-endian float32 (what the OpenAI SDK asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field, ValidationInfo, field_validator

from pagemill.runtime.outputs import EmbeddingRequestOutput
from pagemill.runtime.pooling_params import PoolingParams
from pagemill.server.async_engine import EngineDeadError, QueueFullError
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.limits import STRICT, find_lone_surrogate
from pagemill.server.entrypoints.openai.protocol import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    OpenAIModel,
    random_id,
)
from pagemill.server.entrypoints.openai.serving_base import (
    RETRY_AFTER_SECONDS,
    ServingBase,
    failure,
    now,
)

# OpenAI's own cap on inputs per request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(OpenAIModel):
    model_config = STRICT

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)

    @field_validator("*", mode="before")
    @classmethod
    def _check_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        where = find_lone_surrogate(data, info.field_name or "")
        if where is not None:
            raise ValueError(
                f"'{where}' contains a lone UTF-16 surrogate, which is not valid Unicode text"
            )
        return data

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: EmbeddingInput) -> EmbeddingInput:
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("'input' must not be empty")
        if len(value) > MAX_EMBEDDING_INPUTS and not all(isinstance(x, int) for x in value):
            raise ValueError(f"'input' takes at most {MAX_EMBEDDING_INPUTS} items")
        for x in value:
            if isinstance(x, str) and not x:
                raise ValueError("'input' strings must not be empty")
            if isinstance(x, list) and not x:
                raise ValueError("'input' token lists must not be empty")
            if (isinstance(x, int) and x < 0) or (isinstance(x, list) and min(x) < 0):
                raise ValueError("'input' token ids must be non-negative")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("'truncate_prompt_tokens' must be -1 or >= 1")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The input(s) as a batch: one string, strings, ids, or lists of ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(x, int) for x in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the raw bytes of little-endian float32 values."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class EmbeddingServing(ServingBase):
    async def create(self, req: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        arrival = now()
        self.check_model(req.model)
        try:
            params = PoolingParams(
                normalize=req.normalize,
                dimensions=req.dimensions,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        inputs = await self.off_loop(self._encode_inputs, req)
        request_id = random_id("embd")
        out_queue, ids = await self._submit(request_id, inputs, params, req.priority, arrival)
        outputs = await self._collect(raw_request, out_queue, ids)
        data = []
        n_prompt = 0
        for i, out in enumerate(outputs):
            vector = out.outputs.embedding
            embedding = encode_base64(vector) if req.encoding_format == "base64" else vector
            data.append(EmbeddingData(index=i, embedding=embedding))
            n_prompt += len(out.prompt_token_ids)
        return EmbeddingResponse(
            id=request_id,
            model=self.served_model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=n_prompt, total_tokens=n_prompt),
        )

    def _encode_inputs(self, req: EmbeddingRequest) -> list[str | list[int]]:
        """Text inputs tokenized here (vLLM's `add_special_tokens`); token ids as they are."""
        inputs = req.inputs()
        if req.add_special_tokens:
            return inputs
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="input")
        encoded: list[str | list[int]] = []
        for x in inputs:
            if isinstance(x, str):
                self.check_text_size(x, "input")
                encoded.append(list(self.tokenizer.encode(x, add_special_tokens=False)))
            else:
                encoded.append(x)
        return encoded

    async def _submit(
        self,
        base_id: str,
        inputs: list[str | list[int]],
        params: PoolingParams,
        priority: int,
        arrival: float,
    ) -> tuple[asyncio.Queue[Any], list[str]]:
        limit = self.client.max_pending
        if limit is not None and len(inputs) > limit:
            raise APIError(
                400,
                f"this request has {len(inputs)} inputs but the server's queue holds at most "
                f"{limit}; it can never be served",
                param="input",
            )
        out_queue: asyncio.Queue[Any] = asyncio.Queue()
        ids: list[str] = []
        try:
            for i, prompt in enumerate(inputs):
                rid = f"{base_id}-{i}"
                await self.client.add_request(
                    rid,
                    prompt,
                    params,
                    out_queue=out_queue,
                    priority=priority,
                    arrival_time=arrival,
                )
                ids.append(rid)
        except BaseException as exc:
            for rid in ids:
                self.client.release(rid, finished=False)
            if isinstance(exc, QueueFullError):
                raise APIError(
                    429, f"{exc}; retry shortly", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
                ) from exc
            if isinstance(exc, EngineDeadError):
                raise failure(exc) from exc
            if isinstance(exc, ValueError):
                message = str(exc)
                param = "dimensions" if "dimensions" in message else "input"
                raise APIError(400, message, param=param) from exc
            raise
        return out_queue, ids

    async def _collect(
        self, raw_request: Request, out_queue: asyncio.Queue[Any], ids: list[str]
    ) -> list[EmbeddingRequestOutput]:
        """Every vector in input order; a client that hangs up aborts the rest."""
        final = await self.collect_final(raw_request, out_queue, ids)
        outputs = [final[rid] for rid in ids]
        for i, out in enumerate(outputs):
            if out.finish_reason == "length":
                raise APIError(
                    400,
                    f"input {i} ({len(out.prompt_token_ids)} tokens) needs more KV cache than "
                    "the server's whole pool",
                    param="input",
                )
            if out.finish_reason != "stop":
                raise failure(RuntimeError(f"{out.request_id} ended with {out.finish_reason}"))
        return outputs
