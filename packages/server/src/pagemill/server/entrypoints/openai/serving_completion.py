"""POST /v1/completions: one or many prompts, n choices each, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagemill.server.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pagemill.server.entrypoints.openai.serving_base import (
    SSE_DONE,
    ReleasingStream,
    ServingBase,
    check_failed,
    failure_events,
    now,
    prompt_logprobs_field,
    split_logprobs,
    sse,
    token_text,
    usage_counts,
)


class CompletionServing(ServingBase):
    async def create(
        self, req: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | AsyncIterator[str]:
        arrival = now()
        self.check_model(req.model)
        prompts = req.prompts()
        # OpenAI's default of 16 yields to the model's default max_tokens when it has one.
        unset = "max_tokens" not in req.model_fields_set and "max_tokens" in self.defaults
        params = self.sampling_params(req, None if unset else req.max_tokens, req.logprobs)
        request_id = random_id("cmpl")
        out_queue, ids = await self.submit(
            request_id, prompts, [params] * len(prompts), req, arrival
        )
        if req.stream:
            return ReleasingStream(self._stream(req, request_id, out_queue, ids), self.client, ids)
        finals = await self.collect(raw_request, out_queue, ids)
        choices: list[CompletionChoice] = []
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(c.token_ids, c.logprobs, req.logprobs, 0)
                choices.append(
                    CompletionChoice(
                        index=i * req.n + c.index,
                        text=c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_field(
                            self.tokenizer, out.prompt_logprobs, req.prompt_logprobs or 0
                        ),
                    )
                )
        n_prompt, n_completion = usage_counts(finals)
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=n_prompt,
                completion_tokens=n_completion,
                total_tokens=n_prompt + n_completion,
            ),
        )

    def _logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
        num_top: int,
        text_offset: int,
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = text_offset
        for tid, entry in zip(token_ids, entries or []):
            text = token_text(self.tokenizer, tid)
            sampled_lp, top = split_logprobs(entry, num_top)
            result.tokens.append(text)
            result.token_logprobs.append(sampled_lp)
            result.top_logprobs.append({token_text(self.tokenizer, t): lp for t, lp in top})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def _stream(
        self, req: CompletionRequest, request_id: str, out_queue: Any, ids: list[str]
    ) -> AsyncIterator[str]:
        """Each engine output is already the delta of its choices: forward it as a chunk."""
        created = int(time.time())
        index_of = {rid: i for i, rid in enumerate(ids)}
        sent_chars: dict[int, int] = {}
        n_prompt = n_completion = 0

        def chunk(
            index: int,
            text: str,
            logprobs: CompletionLogprobs | None = None,
            finish: str | None = None,
            stop_reason: Any = None,
        ) -> str:
            return sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.served_model_name,
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs.model_dump() if logprobs else None,
                            "finish_reason": finish,
                            "stop_reason": stop_reason,
                        }
                    ],
                }
            )

        try:
            async with contextlib.aclosing(self.client.stream(out_queue, ids)) as stream:
                async for out in stream:
                    base = index_of[out.request_id] * req.n
                    check_failed(out.outputs)
                    for c in out.outputs:
                        key = base + c.index
                        logprobs = None
                        if req.logprobs is not None and c.logprobs:
                            logprobs = self._logprobs(
                                c.token_ids, c.logprobs, req.logprobs, sent_chars.get(key, 0)
                            )
                        sent_chars[key] = sent_chars.get(key, 0) + len(c.text)
                        n_completion += len(c.token_ids)
                        if c.finish_reason is not None:
                            yield chunk(key, c.text, logprobs, c.finish_reason, c.stop_reason)
                        elif c.text or logprobs:
                            yield chunk(key, c.text, logprobs)
                    if out.finished:
                        n_prompt += len(out.prompt_token_ids)
        except Exception as exc:  # the engine or this server failed: say so, then end
            for event in failure_events(exc):
                yield event
            return
        if req.include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.served_model_name,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": n_completion,
                        "total_tokens": n_prompt + n_completion,
                    },
                }
            )
        yield SSE_DONE
