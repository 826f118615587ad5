"""What completions and chat share: prompt checks, sampling params, submission, collection.

Every check that can fail because of the request runs before the first byte is sent, so a
bad request is a clean 4xx even when it asked for a stream. Prompts are tokenized here so
that context-length errors can name exact numbers and `max_tokens=None` can mean "the rest
of the context" — but never on the event loop: a multi-megabyte prompt takes seconds to
tokenize, and every other stream and /health would wait for it. Tokenization and chat
templating run on one worker thread (the tokenizer's encode is safe beside the engine
thread's decode; one worker keeps encodes from racing each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request

from pagemill.runtime import RequestOutputKind, SamplingParams
from pagemill.runtime.lora import LoRARequest
from pagemill.runtime.sample.structured_output import is_grammar_failure
from pagemill.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    ServerShuttingDownError,
)
from pagemill.server.entrypoints.openai.errors import APIError, error_body, internal_error
from pagemill.server.entrypoints.openai.protocol import (
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
    random_id,
)
from pagemill.server.entrypoints.openai.serving_lora import LoRARegistry
from pagemill.server.entrypoints.openai.structured import logit_bias, structured_params

RETRY_AFTER_SECONDS = 1

T = TypeVar("T")


def sse(payload: Any) -> str:
    """One server-sent event carrying a JSON body (pydantic model or dict)."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class RequestFailedError(RuntimeError):
    """The engine finished one of this request's choices with finish_reason "error"."""


def failure(exc: BaseException) -> APIError:
    """What a client is told when its request cannot complete: never the internals."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerShuttingDownError):
        return APIError(503, f"{exc}; retry shortly", code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return internal_error(503, "the engine is unavailable", exc)
    if isinstance(exc, RequestFailedError):
        return internal_error(500, "the engine failed while computing this request", exc)
    return internal_error(500, "internal server error", exc)


def failure_events(exc: BaseException) -> list[str]:
    """The last events of a stream that cannot go on: an error object, then [DONE]."""
    err = failure(exc)
    return [sse(error_body(err.status_code, err.message, code=err.code)), SSE_DONE]


def check_failed(outputs: Sequence[Any]) -> None:
    for c in outputs:
        if c.finish_reason == "error":
            if is_grammar_failure(c.stop_reason):  # the client's grammar: a 400
                raise APIError(400, c.stop_reason, param="structured_outputs")
            raise RequestFailedError(f"choice {c.index}: {c.stop_reason}")


def _param_of(message: str) -> str | None:
    """The request field a validation message is about, for OpenAI's `param`."""
    named = re.match(r"SamplingParams\.(\w+)", message)
    if named:
        return named.group(1)
    for field in (
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "min_tokens",
        "max_tokens",
        "logit_bias",
        "prompt",
    ):
        if field in message:
            return field
    return None


class ServingBase:
    """Holds the engine client and the model facts every endpoint needs."""

    def __init__(
        self,
        client: AsyncEngine,
        served_model_name: str | Sequence[str],
        *,
        max_model_len: int,
        tokenizer: Any,
        vocab_limit: int | None = None,
        tokenizer_pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.client = client
        self.tokenizer_pool = tokenizer_pool or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagemill-tokenizer"
        )
        # Every name is accepted in requests; the first is the one responses report.
        self.served_model_names = (
            [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        )
        self.served_model_name = self.served_model_names[0]
        # The model's generation-config defaults for sampling fields a request leaves unset.
        self.defaults: dict[str, Any] = dict(client.generation_defaults)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        if vocab_limit is None:
            vocab_limit = len(tokenizer) if tokenizer is not None else 2**31
        self.vocab_limit = vocab_limit
        # LoRA adapters by name (`serving_lora`), set by build_app when the engine serves them.
        self.loras: LoRARegistry | None = None

    # ------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            if self.lora_request(model) is not None:
                return
            served = self.served_model_names
            if self.loras is not None:
                served = served + [a.lora_name for a in self.loras.adapters()]
            names = ", ".join(f"'{n}'" for n in served)
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves {names}.",
                param="model",
                code="model_not_found",
            )

    def response_model(self, model: str | None) -> str:
        """The name a response reports: the adapter's when the request named one (as vLLM
        does, so a client can tell which adapter answered), else the served model's."""
        if model is not None and self.lora_request(model) is not None:
            return model
        return self.served_model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return None if self.loras is None else self.loras.get(model)

    def default(self, req: SamplingFields, name: str, api_default: Any) -> Any:
        """A sampling field as sent, else the model's default (--generation-config), else
        the API's. A field is unset when the body leaves it out or sends null."""
        value = getattr(req, name)
        if name in req.model_fields_set and value is not None:
            return value
        return self.defaults.get(name, api_default if value is None else value)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work on the tokenizer thread, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def check_text_size(self, text: str, param: str) -> None:
        """Refuse text that can never fit the context without tokenizing it (blocking:
        O(len), call through `off_loop`)."""
        try:
            self.client.input_processor.check_text_size(text, param)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        tool_schema: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; `tool_schema` forces a tool call (chat).

        `max_tokens` None: the model's default max_tokens capped to the room the prompt
        leaves, else all of it (the input processor decides, once it knows the prompt).
        """
        structured = structured_params(req, tool_schema)
        bias = logit_bias(req, self.vocab_limit)
        # A stream takes each step's new text as it comes; a whole answer is built once.
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(
                n=req.n,
                temperature=self.default(req, "temperature", 1.0),
                top_p=self.default(req, "top_p", 1.0),
                top_k=self.default(req, "top_k", 0),
                min_p=self.default(req, "min_p", 0.0),
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop_list or None,
                stop_token_ids=list(req.stop_token_ids or ()),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=self.default(req, "repetition_penalty", 1.0),
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=kind,
                logit_bias=bias,
                structured_outputs=structured,
                bad_words=list(req.bad_words) if req.bad_words else None,
                allowed_token_ids=req.allowed_token_ids,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                prompt_logprobs=req.prompt_logprobs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_of(str(exc))) from exc

    # ------------------------------------------------------------ submission

    async def submit(
        self,
        base_id: str,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        req: SamplingFields,
        arrival_time: float,
    ) -> tuple[asyncio.Queue[Any], list[str]]:
        """Add one engine request per prompt, all feeding one queue; errors become APIErrors.

        The front end validates each (tokenizing text off the event loop): its ValueError
        is a 400 naming the problem. `arrival_time` is when the HTTP request arrived
        (monotonic): tokenization and the wait for the engine count towards the latency a
        client sees.
        """
        total = sum(sp.n for sp in params)
        limit = self.client.max_pending
        if limit is not None and total > limit:
            raise APIError(
                400,
                f"this request needs {total} sequences (prompts x n) but the "
                f"server's queue holds at most {limit}; it can never be "
                "served",
                param="n",
            )
        out_queue: asyncio.Queue[Any] = asyncio.Queue()
        ids: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = f"{base_id}-{i}"
                await self.client.add_request(
                    rid,
                    prompt,
                    sp,
                    out_queue=out_queue,
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    arrival_time=arrival_time,
                    lora_request=self.lora_request(getattr(req, "model", None)),
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
                raise APIError(400, str(exc), param=_param_of(str(exc))) from exc
            raise
        return out_queue, ids

    async def collect(
        self, raw_request: Request, out_queue: asyncio.Queue[Any], ids: list[str]
    ) -> list[Any]:
        """Final outputs in prompt order; a client that hangs up aborts the requests."""
        final = await self.collect_final(raw_request, out_queue, ids)
        for out in final.values():
            try:
                check_failed(out.outputs)
            except RequestFailedError as exc:
                raise failure(RequestFailedError(f"{out.request_id}: {out.outputs}")) from exc
        return [final[rid] for rid in ids]

    async def collect_final(
        self, raw_request: Request, out_queue: asyncio.Queue[Any], ids: list[str]
    ) -> dict[str, Any]:
        """Each request's final output, by id (a 499 if the client hangs up first).

        A watcher waits for the connection's `http.disconnect` beside the collection, so a
        request still queued (no outputs to notice it by) is aborted as soon as the client
        leaves, the same as a stream.
        """

        async def gather() -> dict[str, Any]:
            final: dict[str, Any] = {}
            async with contextlib.aclosing(self.client.stream(out_queue, ids)) as stream:
                async for out in stream:
                    if out.finished:
                        final[out.request_id] = out
            return final

        async def watch() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass

        collecting = asyncio.ensure_future(gather())
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collecting, watcher):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if not collecting.done() or collecting.cancelled():
            raise APIError(499, "client disconnected")
        try:
            return collecting.result()
        except EngineDeadError as exc:
            raise failure(exc) from exc


class ReleasingStream:
    """An SSE body that returns its engine requests even if it is closed before it starts.

    A never-started async generator runs no `finally` on close, so a client that hangs up
    between the submit and the first chunk would otherwise leave its requests running.
    """

    def __init__(self, body: AsyncIterator[str], client: AsyncEngine, ids: list[str]) -> None:
        self._body = body
        self._client = client
        self._ids = ids

    def __aiter__(self) -> ReleasingStream:
        return self

    async def __anext__(self) -> str:
        return await self._body.__anext__()

    async def aclose(self) -> None:
        try:
            await self._body.aclose()  # type: ignore[attr-defined]
        finally:
            for rid in self._ids:
                self._client.release(rid, finished=False)


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def split_logprobs(entry: dict[int, float], num_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(sampled token's logprob, top-n [(id, logprob)]) from the runtime's per-token dict.

    The runtime puts the sampled token first, then the top-n (without repeating it).
    """
    items = list(entry.items())
    sampled_lp = items[0][1] if items else float("nan")
    top = sorted(items, key=lambda kv: kv[1], reverse=True)[:num_top] if num_top else []
    return sampled_lp, top


def prompt_logprobs_field(
    tokenizer: Any, entries: list[dict[int, float] | None] | None, num_top: int
) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` from the runtime's (the prompt token first, then the top
    `num_top` without repeating it): ranks by logprob; the prompt token's rank is known
    only when it is one of the top `num_top` (else it is left out: None)."""
    if entries is None:
        return None
    out: list[dict[int, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())
        in_top = num_top > 0 and len(items) == num_top
        ranked = sorted(items if in_top else items[1:], key=lambda kv: kv[1], reverse=True)
        rank = {t: i for i, (t, _) in enumerate(ranked, start=1)}
        out.append(
            {
                t: PromptLogprob(
                    logprob=lp, rank=rank.get(t), decoded_token=token_text(tokenizer, t)
                )
                for t, lp in items
            }
        )
    return out


def now() -> float:
    """The clock of arrival times (the engine's: monotonic)."""
    return time.monotonic()


def usage_counts(outputs: Sequence[Any]) -> tuple[int, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, completion


def cached_tokens(out: Any) -> int:
    """Prompt tokens of one engine request that the prefix cache already held (the engine
    reports them with the request's first tokens)."""
    metrics = getattr(out, "metrics", None)
    return int(getattr(metrics, "num_cached_tokens", 0) or 0)


def usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def engine_id(prefix: str, response: str, req: SamplingFields) -> str:
    """The base of the engine's ids: the response's own, unless the client chose it."""
    return random_id(prefix) if req.request_id else response


def response_id(prefix: str, req: SamplingFields) -> str:
    """The id a response carries: built from the client's `request_id` when it sent one
    (vLLM's), else random. The engine's own ids stay random: two clients choosing the
    same request_id must not collide inside the engine."""
    return f"{prefix}-{req.request_id}" if req.request_id else random_id(prefix)
