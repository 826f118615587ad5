"""POST /v1/chat/completions: messages through the model's chat template, whole or streamed.

Special tokens: the template's output is tokenized with special-token strings recognised
(the template writes its own turn markers that way), so a message whose content held
`<|im_start|>system` would forge a turn. By default such content is refused (400, naming
the token); `allow_special_tokens=True` (`pagemill serve --allow-special-tokens-in-chat`)
restores the raw behaviour for trusted clients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagemill.runtime import SamplingParams
from pagemill.runtime.reasoning import ReasoningParser, get_reasoning_parser
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
)
from pagemill.server.entrypoints.openai.protocol_structured import ToolCallMessage
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
from pagemill.server.entrypoints.openai.serving_reasoning import ChoiceStream
from pagemill.server.entrypoints.openai.serving_tools import ToolPlan


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


def prompt_length(req: ChatCompletionRequest, prompt: list[int]) -> int:
    """The prompt tokens the engine will read (after truncate_prompt_tokens), for the usage
    of chunks sent before its first output."""
    keep = req.truncate_prompt_tokens
    if keep is None or keep == -1:  # -1 cuts only what could never run anyway
        return len(prompt)
    return min(len(prompt), keep)


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply is prefixed with the final message when that message
    is the assistant's (what continue_final_message continues)."""
    if req.echo and req.messages[-1].role == "assistant":
        return req.messages[-1].text()
    return ""


class ChatServing(ServingBase):
    def __init__(
        self,
        *args: Any,
        tool_parser: str | None = None,
        allow_special_tokens: bool = False,
        reasoning_parser: str | None = None,
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
        # `--reasoning-parser`: one parser per request (it reads chat_template_kwargs).
        self.reasoning_parser = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        )
        # Special tokens a format's markers need kept in the text; the end-of-turn ones
        # that then appear at the end of an answer are cut off again (`_trim_special`).
        self._special_texts = sorted(
            {t for t in getattr(self.tokenizer, "all_special_tokens", None) or [] if t},
            key=len,
            reverse=True,
        )

    def reasoner(self, req: ChatCompletionRequest, prompt: list[int]) -> ReasoningParser | None:
        """This request's reasoning parser; None when there is none or the output holds no
        reasoning (thinking switched off, or the prompt already closed it)."""
        if self.reasoning_parser is None:
            return None
        kwargs = getattr(req, "chat_template_kwargs", None)
        parser = self.reasoning_parser(self.tokenizer, kwargs if isinstance(kwargs, dict) else None)
        if not parser.thinking_enabled or parser.prompt_ends_reasoning(prompt):
            return None
        return parser

    def gate_grammar(self, params: SamplingParams, reasoner: ReasoningParser | None) -> None:
        """A structured-output constraint applies to the answer, after the reasoning, as in
        vLLM: the engine lets the reasoning run free until its end token."""
        so = params.structured_outputs
        if so is None or reasoner is None:
            return
        end_ids = reasoner.end_token_ids
        if not end_ids:
            raise APIError(
                400,
                f"structured output (response_format, structured_outputs or tool_choice) "
                f"cannot be combined with the {reasoner.name} reasoning parser for this "
                f"model: {reasoner.end_token!r} is not a single token of its vocabulary, "
                "so the constraint could not start where the reasoning ends",
                param="response_format",
            )
        params.structured_outputs = dataclasses.replace(so, reasoning_end_token_ids=end_ids)

    def _trim_special(self, text: str) -> str:
        """An answer decoded with special tokens kept, without the end-of-turn token(s)."""
        trimmed = True
        while trimmed and text:
            trimmed = False
            for token in self._special_texts:
                if text.endswith(token):
                    text, trimmed = text[: -len(token)], True
                    break
        return text

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
            ids = self.client.input_processor.apply_chat_template(
                messages,
                req.add_generation_prompt,
                tools=tools,
                template_kwargs=req.template_kwargs,
                add_special_tokens=bool(req.add_special_tokens),
            )
        except Exception as exc:  # no template, or one that rejects e.g. this role order
            if req.continue_final_message and isinstance(exc, ValueError):
                # transformers: the template did not write the final message as sent.
                raise APIError(
                    400,
                    f"continue_final_message: {str(exc)[:300]}",
                    param="continue_final_message",
                ) from exc
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
        keep_special = (
            plan.mode == "auto"
            and self.tool_parser.needs_special_tokens
            and "skip_special_tokens" not in req.model_fields_set
        )
        if keep_special:  # the format's markers are special tokens (as vLLM does)
            req = req.model_copy(update={"skip_special_tokens": False})
        params = self.sampling_params(req, req.effective_max_tokens, req.num_logprobs, plan.schema)
        reasoner = self.reasoner(req, prompt)
        self.gate_grammar(params, reasoner)
        trim = self._trim_special if keep_special else None
        request_id = response_id("chatcmpl", req)
        out_queue, ids = await self.submit(
            engine_id("chatcmpl", request_id, req), [prompt], [params], req, arrival
        )
        if req.stream:
            return ReleasingStream(
                self._stream(
                    req,
                    plan,
                    reasoner,
                    trim,
                    request_id,
                    out_queue,
                    ids,
                    prompt_length(req, prompt),
                ),
                self.client,
                ids,
            )
        (final,) = await self.collect(raw_request, out_queue, ids)
        echo = echo_text(req)
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = None
            if req.num_logprobs is not None:
                logprobs = self._logprobs(
                    c.token_ids, c.logprobs, req.num_logprobs, req.tokens_as_ids
                )
            text = trim(c.text) if trim is not None else c.text
            reasoning = None
            if reasoner is not None:
                reasoning, text = reasoner.split(text, final=True)
                if not req.include_reasoning:
                    reasoning = None
            content, calls = plan.finish(text)
            if echo:
                content = echo + (content or "")
            message = ChatResponseMessage(
                content=(content or None) if reasoner is not None else content,
                reasoning_content=reasoning or None,
                reasoning=reasoning or None,
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
            model=self.response_model(req.model),
            choices=choices,
            prompt_logprobs=prompt_logprobs_field(
                self.tokenizer, final.prompt_logprobs, req.prompt_logprobs or 0
            ),
            usage=usage(n_prompt, n_completion, cached_tokens(final)),
        )

    def _logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
        num_top: int,
        as_ids: bool = False,
    ) -> ChatChoiceLogprobs:
        """`as_ids` (vLLM's return_tokens_as_token_ids): tokens written `token_id:<id>`."""
        named = None if as_ids else self.tokenizer
        content: list[ChatTokenLogprob] = []
        for tid, entry in zip(token_ids, entries or []):
            text = token_text(named, tid)
            sampled_lp, top = split_logprobs(entry, num_top)
            tops = []
            for t, lp in top:
                t_text = token_text(named, t)
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
        reasoner: ReasoningParser | None,
        trim: Any,
        request_id: str,
        out_queue: Any,
        ids: list[str],
        num_prompt_tokens: int = 0,
    ) -> AsyncIterator[str]:
        """Each engine output is already the delta of its choices: forward it as a chunk."""
        created = int(time.time())
        n_prompt, n_completion, n_cached = num_prompt_tokens, 0, 0

        def chunk(
            index: int,
            delta: dict[str, Any],
            logprobs: ChatChoiceLogprobs | None = None,
            finish: str | None = None,
            stop_reason: Any = None,
        ) -> str:
            body: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.response_model(req.model),
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
            if req.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
                body["usage"] = usage(n_prompt, n_completion, n_cached).model_dump()
            return sse(body)

        # The role comes first, once per choice, as OpenAI sends it (with `echo`, the
        # assistant's final message, which the reply continues).
        echo = echo_text(req)
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": echo})
        tool_streams = [ChoiceStream(plan, reasoner, req.include_reasoning) for _ in range(req.n)]
        try:
            async with contextlib.aclosing(self.client.stream(out_queue, ids)) as stream:
                async for out in stream:
                    check_failed(out.outputs)
                    n_prompt = len(out.prompt_token_ids)
                    n_cached = cached_tokens(out)
                    for c in out.outputs:
                        logprobs = None
                        if req.num_logprobs is not None and c.logprobs:
                            logprobs = self._logprobs(
                                c.token_ids, c.logprobs, req.num_logprobs, req.tokens_as_ids
                            )
                        n_completion += len(c.token_ids)
                        tools = tool_streams[c.index]
                        text = c.text
                        if trim is not None and c.finish_reason is not None:
                            text = trim(text)
                        deltas = tools.feed(text) if text else []
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
                    "model": self.response_model(req.model),
                    "choices": [],
                    "usage": usage(n_prompt, n_completion, n_cached).model_dump(),
                }
            )
        yield SSE_DONE
