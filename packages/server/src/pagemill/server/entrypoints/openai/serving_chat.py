"""POST /v1/chat/completions: messages through the model's chat template, whole or streamed.

Special tokens: the template's output is tokenized with special-token strings recognised
(the template writes its own turn markers that way), so a message whose content held
`<|im_start|>system` would forge a turn. By default such content is refused (400, naming
the token); `allow_special_tokens=True` (`pagemill serve --allow-special-tokens-in-chat`)
restores the raw behaviour for trusted clients.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagemill.runtime.tool_calling import get_tool_parser, parser_for_template
from pagemill.server.entrypoints.openai.errors import APIError, internal_error
from pagemill.server.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pagemill.server.entrypoints.openai.protocol_structured import ToolCallMessage
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
from pagemill.server.entrypoints.openai.serving_tools import ToolPlan, ToolStream


def special_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex matching any special-token string of the tokenizer (None: it has none)."""
    if tokenizer is None:
        return None
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            tokens.add(str(added.content))
    tokens = {t for t in tokens if t}
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class ChatServing(ServingBase):
    def __init__(
        self,
        *args: Any,
        tool_parser: str | None = None,
        allow_special_tokens: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # The format "auto" tool calls are read in: named, or guessed from the template.
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = get_tool_parser(
            tool_parser or parser_for_template(template if isinstance(template, str) else None)
        )
        self.allow_special_tokens = allow_special_tokens
        self._special = None if allow_special_tokens else special_token_pattern(self.tokenizer)

    def render(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        """The conversation's prompt ids (blocking: runs on the tokenizer thread)."""
        messages = []
        for m in req.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        tools = plan.template_tools if plan is not None else None
        if self.tokenizer is not None:
            self.check_text_size("".join(m["content"] for m in messages), "messages")
        if self._special is not None:
            for i, message in enumerate(messages):
                found = self._special.search(message["content"])
                if found:
                    raise APIError(
                        400,
                        f"messages[{i}].content contains the special token "
                        f"{found.group()!r}, which could forge a turn of the "
                        "conversation; remove it (the server refuses these "
                        "unless started with --allow-special-tokens-in-chat)",
                        param="messages",
                        code="special_token_in_content",
                    )
        try:
            ids = self.client.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tools=tools
            )
        except Exception as exc:  # no template, or one that rejects e.g. this role order
            if type(exc).__module__.startswith("jinja2"):  # the template's own words
                raise APIError(
                    400,
                    f"the chat template refused these messages: {str(exc)[:300]}",
                    param="messages",
                ) from exc
            raise internal_error(
                400, "the chat template could not render these messages", exc
            ) from exc
        return list(ids)

    async def create(
        self, req: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        arrival = now()
        self.check_model(req.model)
        plan = ToolPlan.from_request(req, self.tool_parser)
        prompt = await self.off_loop(self.render, req, plan)
        params = self.sampling_params(req, req.effective_max_tokens, req.num_logprobs, plan.schema)
        request_id = random_id("chatcmpl")
        out_queue, ids = await self.submit(request_id, [prompt], [params], req, arrival)
        if req.stream:
            return ReleasingStream(
                self._stream(req, plan, request_id, out_queue, ids), self.client, ids
            )
        (final,) = await self.collect(raw_request, out_queue, ids)
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = None
            if req.num_logprobs is not None:
                logprobs = self._logprobs(c.token_ids, c.logprobs, req.num_logprobs)
            content, calls = plan.finish(c.text)
            message = ChatResponseMessage(
                content=content,
                tool_calls=[ToolCallMessage.model_validate(call.to_openai()) for call in calls],
            )
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=plan.finish_reason(c.finish_reason, calls),
                    stop_reason=c.stop_reason,
                )
            )
        n_prompt, n_completion = usage_counts([final])
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            prompt_logprobs=prompt_logprobs_field(
                self.tokenizer, final.prompt_logprobs, req.prompt_logprobs or 0
            ),
            usage=UsageInfo(
                prompt_tokens=n_prompt,
                completion_tokens=n_completion,
                total_tokens=n_prompt + n_completion,
            ),
        )

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]] | None, num_top: int
    ) -> ChatChoiceLogprobs:
        content: list[ChatTokenLogprob] = []
        for tid, entry in zip(token_ids, entries or []):
            text = token_text(self.tokenizer, tid)
            sampled_lp, top = split_logprobs(entry, num_top)
            tops = []
            for t, lp in top:
                t_text = token_text(self.tokenizer, t)
                tops.append(TopLogprob(token=t_text, logprob=lp, bytes=list(t_text.encode())))
            content.append(
                ChatTokenLogprob(
                    token=text, logprob=sampled_lp, bytes=list(text.encode()), top_logprobs=tops
                )
            )
        return ChatChoiceLogprobs(content=content)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        request_id: str,
        out_queue: Any,
        ids: list[str],
    ) -> AsyncIterator[str]:
        """Each engine output is already the delta of its choices: forward it as a chunk."""
        created = int(time.time())
        n_prompt = n_completion = 0

        def chunk(
            index: int,
            delta: dict[str, Any],
            logprobs: ChatChoiceLogprobs | None = None,
            finish: str | None = None,
            stop_reason: Any = None,
        ) -> str:
            return sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.served_model_name,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs.model_dump() if logprobs else None,
                            "finish_reason": finish,
                            "stop_reason": stop_reason,
                        }
                    ],
                }
            )

        # The role comes first, once per choice, as OpenAI sends it.
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        tool_streams = [ToolStream(plan) for _ in range(req.n)]
        try:
            async with contextlib.aclosing(self.client.stream(out_queue, ids)) as stream:
                async for out in stream:
                    check_failed(out.outputs)
                    for c in out.outputs:
                        logprobs = None
                        if req.num_logprobs is not None and c.logprobs:
                            logprobs = self._logprobs(c.token_ids, c.logprobs, req.num_logprobs)
                        n_completion += len(c.token_ids)
                        tools = tool_streams[c.index]
                        deltas = tools.feed(c.text) if c.text else []
                        if c.finish_reason is not None:
                            deltas += tools.finish()
                        for delta in deltas[:-1]:
                            yield chunk(c.index, delta)
                        delta = deltas[-1] if deltas else {}
                        if c.finish_reason is not None:
                            reason = plan.finish_reason(c.finish_reason, tools.calls)
                            yield chunk(c.index, delta, logprobs, reason, c.stop_reason)
                        elif delta or logprobs:
                            yield chunk(c.index, delta, logprobs)
                    if out.finished:
                        n_prompt = len(out.prompt_token_ids)
        except Exception as exc:  # the engine or this server failed: say so, then end
            for event in failure_events(exc):
                yield event
            return
        if req.include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
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
