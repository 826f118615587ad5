"""POST /v1/completions: one or many prompts, n choices each, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagemill.server.entrypoints.openai.serving_base import (
    SSE_DONE,
    ReleasingStream,
    ServingBase,
    cached_tokens,
    check_failed,
    engine_id,
    failure_events,
    now,
    prompt_logprobs_field,
    response_id,
    split_logprobs,
    sse,
    token_text,
    usage,
    usage_counts,
)


class CompletionServing(ServingBase):
    async def create(
        self, req: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | AsyncIterator[str]:
        arrival = now()
        self.check_model(req.model)
        prompts = req.prompts()
        if req.add_special_tokens is False:  # vLLM's default for completions is True
            prompts = [
                await self.off_loop(self._encode_plain, p) if isinstance(p, str) else p
                for p in prompts
            ]
        # OpenAI's default of 16 yields to the model's default max_tokens when it has one.
        unset = "max_tokens" not in req.model_fields_set and "max_tokens" in self.defaults
        params = self.sampling_params(req, None if unset else req.max_tokens, req.logprobs)
        request_id = response_id("cmpl", req)
        out_queue, ids = await self.submit(
            engine_id("cmpl", request_id, req), prompts, [params] * len(prompts), req, arrival
        )
        if req.stream:
            return ReleasingStream(self._stream(req, request_id, out_queue, ids), self.client, ids)
        finals = await self.collect(raw_request, out_queue, ids)
        choices: list[CompletionChoice] = []
        for i, out in enumerate(finals):
            echo = self._echo(out) if req.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(
                        c.token_ids, c.logprobs, req.logprobs, 0, req.tokens_as_ids
                    )
                choices.append(
                    CompletionChoice(
                        index=i * req.n + c.index,
                        text=echo + c.text,
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
            model=self.response_model(req.model),
            choices=choices,
            usage=usage(n_prompt, n_completion, sum(cached_tokens(o) for o in finals)),
        )

    def _encode_plain(self, prompt: str) -> list[int]:
        """A prompt's ids without the tokenizer's own special tokens (blocking)."""
        try:
            return self.client.input_processor.encode(prompt, add_special_tokens=False)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc

    def _echo(self, out: Any) -> str:
        """The prompt as `echo` repeats it: the text sent, or, for token ids (or a prompt
        that truncate_prompt_tokens cut), the text of the ids the model read."""
        if out.prompt is not None:
            return str(out.prompt)
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(out.prompt_token_ids))

    def _logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
        num_top: int,
        text_offset: int,
        as_ids: bool = False,
    ) -> CompletionLogprobs:
        """`as_ids` (vLLM's return_tokens_as_token_ids): tokens written `token_id:<id>`;
        the text offsets stay those of the text."""
        result = CompletionLogprobs()
        offset = text_offset
        named = None if as_ids else self.tokenizer
        for tid, entry in zip(token_ids, entries or []):
            text = token_text(self.tokenizer, tid)
            sampled_lp, top = split_logprobs(entry, num_top)
            result.tokens.append(text if named is not None else token_text(None, tid))
            result.token_logprobs.append(sampled_lp)
            result.top_logprobs.append({token_text(named, t): lp for t, lp in top})
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
        n_completion = 0
        # Per engine request: its prompt length and cached tokens, once it has output.
        prompt_of: dict[str, int] = {}
        cached_of: dict[str, int] = {}

        def usage_now() -> dict[str, Any]:
            return usage(
                sum(prompt_of.values()), n_completion, sum(cached_of.values())
            ).model_dump()

        def chunk(
            index: int,
            text: str,
            logprobs: CompletionLogprobs | None = None,
            finish: str | None = None,
            stop_reason: Any = None,
        ) -> str:
            body: dict[str, Any] = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.response_model(req.model),
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
            if req.continuous_usage:
                body["usage"] = usage_now()
            return sse(body)

        try:
            async with contextlib.aclosing(self.client.stream(out_queue, ids)) as stream:
                async for out in stream:
                    base = index_of[out.request_id] * req.n
                    check_failed(out.outputs)
                    if out.request_id not in prompt_of:
                        prompt_of[out.request_id] = len(out.prompt_token_ids)
                    cached_of[out.request_id] = cached_tokens(out)
                    for c in out.outputs:
                        key = base + c.index
                        if req.echo and key not in sent_chars:
                            # The prompt goes first, in a chunk of its own (as vLLM).
                            yield chunk(key, self._echo(out))
                        n_completion += len(c.token_ids)
                        logprobs = None
                        if req.logprobs is not None and c.logprobs:
                            logprobs = self._logprobs(
                                c.token_ids,
                                c.logprobs,
                                req.logprobs,
                                sent_chars.get(key, 0),
                                req.tokens_as_ids,
                            )
                        sent_chars[key] = sent_chars.get(key, 0) + len(c.text)
                        if c.finish_reason is not None:
                            yield chunk(key, c.text, logprobs, c.finish_reason, c.stop_reason)
                        elif c.text or logprobs:
                            yield chunk(key, c.text, logprobs)
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
                    "model": self.response_model(req.model),
                    "choices": [],
                    "usage": usage_now(),
                }
            )
        yield SSE_DONE
