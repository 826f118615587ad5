"""The offline API: a batch of prompts in, their completions out, in input order.

`LLM` adds every prompt to an `LLMEngine` and steps it until all are done; continuous
batching does the rest. Names and behaviour follow vLLM's `LLM` so existing scripts port:
prompts in vLLM's forms (`inputs`), and outputs shaped as vLLM's (`RequestOutput` with
`prompt_token_ids`, per-token `Logprob` objects carrying rank and decoded text).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, cast

from pagemill.runtime.chat_template import resolve_chat_template
from pagemill.runtime.config import DEFAULT_MODEL, EngineConfig
from pagemill.runtime.engine import LLMEngine
from pagemill.runtime.inputs import ParsedPrompt, PromptType, as_prompt_list, parse_prompt
from pagemill.runtime.lora.request import LoRARequest
from pagemill.runtime.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    SampleLogprobs,
    rank_logprobs,
)
from pagemill.runtime.pooling_params import PoolingParams
from pagemill.runtime.sampling_params import RequestOutputKind, SamplingParams

Prompt = PromptType | Sequence[int]
Message = dict[str, Any]


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams(...))`; engine options as keywords."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers now rather than at exit; idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt, in vLLM's forms: a string, `{"prompt": text}`,
        `{"prompt_token_ids": [...]}` (a `TextPrompt` / `TokensPrompt`), a list of token
        ids, or a list mixing them.

        One SamplingParams applies to all prompts; a list gives one per prompt. `priority`
        (one per prompt) matters under `scheduling_policy="priority"`. Outputs come in input
        order, each with its `prompt_token_ids` and, when logprobs were asked for, vLLM's
        `Logprob` objects. `lora_request` (an engine with ``enable_lora=True``) runs every
        prompt with that adapter, or one per prompt from a list (None: the base model).
        """
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []
        parsed = [parse_prompt(p) for p in as_prompt_list(prompts)]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(parsed)
        else:
            if not isinstance(lora_request, (list, tuple)) or not all(
                r is None or isinstance(r, LoRARequest) for r in lora_request
            ):
                raise ValueError(
                    "lora_request must be a LoRARequest, a list of them (None for the base "
                    f"model) or None, got {type(lora_request).__name__}"
                )
            loras = list(lora_request)
            if len(loras) != len(parsed):
                raise ValueError(
                    f"got {len(loras)} LoRA requests for {len(parsed)} prompts; "
                    "pass one or one per prompt"
                )
        return self._run(parsed, sampling_params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Complete one conversation or a list of them, through the model's chat template
        (or `chat_template`: a Jinja file or the template itself, for this call only).

        `tools` (OpenAI function definitions) go into the prompt (see
        `tool_calling.render_chat`); parse calls out of the text with
        `tool_calling.get_tool_parser`, or force one with `structured_outputs`.
        """
        if not messages:
            raise ValueError("messages is empty")
        template = None if chat_template is None else resolve_chat_template(chat_template)
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            ParsedPrompt(
                self.llm_engine.apply_chat_template(
                    c,  # type: ignore[arg-type]
                    add_generation_prompt=add_generation_prompt,
                    chat_template=template,
                    tools=tools,
                )
            )
            for c in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[ParsedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:  # the model's generation-config defaults, as vLLM
            params_list = [self.llm_engine.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "pass one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # Offline callers want each request once, whole: no per-step output objects at all.
        final: dict[int, SamplingParams] = {}
        for p in params_list:
            if id(p) not in final:
                final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        params_list = [final[id(p)] for p in params_list]
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = f"llm-{next(self._counter)}"
                engine.add_request(
                    rid,
                    prompt.prompt,
                    params,
                    priority=0 if priority is None else priority[i],
                    cache_salt=prompt.cache_salt,
                    lora_request=None if loras is None else loras[i],
                )
                order[rid] = i
        except BaseException:
            engine.abort_request(list(order))
            engine.step()  # deliver (and drop) the abort outputs
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        try:
            remaining = len(order)
            while remaining:
                for out in engine.step():
                    idx = order.get(out.request_id)
                    if idx is None or not out.finished or not isinstance(out, RequestOutput):
                        continue
                    results[idx] = self._vllm_shaped(out, prompts[idx], params_list[idx])
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r, i in order.items() if results[i] is None])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def _vllm_shaped(
        self, out: RequestOutput, prompt: ParsedPrompt, params: SamplingParams
    ) -> RequestOutput:
        """The engine's output with vLLM's details: the prompt text a TokensPrompt carried,
        and `Logprob` objects (rank, decoded token) in place of plain floats."""
        if out.prompt is None and prompt.text is not None:
            out.prompt = prompt.text
        tokenizer = self.llm_engine.tokenizer

        def decode(token_id: int) -> str | None:
            return None if tokenizer is None else tokenizer.decode([token_id])

        if params.prompt_logprobs is not None and out.prompt_logprobs is not None:
            n_prompt = params.prompt_logprobs
            out.prompt_logprobs = [
                None if e is None else cast(dict[int, float], rank_logprobs(e, n_prompt, decode))
                for e in out.prompt_logprobs
            ]
        if params.logprobs is None:
            return out
        num = params.logprobs

        out.outputs = [
            c
            if c.logprobs is None
            else CompletionOutput(
                c.index,
                c.text,
                c.token_ids,
                c.cumulative_logprob,
                # Logprob is a float: the entries still read as SampleLogprobs.
                cast(SampleLogprobs, [rank_logprobs(e, num, decode) for e in c.logprobs]),
                c.finish_reason,
                c.stop_reason,
            )
            for c in out.outputs
        ]
        return out

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding (`outputs.embedding`) per prompt, in input order (vLLM's `embed`).

        Prompts run through the same scheduler as generation (batched, chunked); pooling
        defaults come from the model (see `PoolingParams`).
        """
        prompt_list = [parse_prompt(p) for p in as_prompt_list(prompts)]
        if any(p.cache_salt is not None for p in prompt_list):
            raise ValueError("cache_salt is not supported for embeddings (generate takes it)")
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} PoolingParams for {len(prompt_list)} prompts; "
                    "pass one or one per prompt"
                )
        if truncate_prompt_tokens is not None:
            params_list = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        engine = self.llm_engine
        order: dict[str, int] = {}
        results: list[EmbeddingRequestOutput | None] = [None] * len(prompt_list)
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                rid = f"embd-{next(self._counter)}"
                engine.add_request(rid, prompt.prompt, params)
                order[rid] = i
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(order), desc="Embedded prompts", dynamic_ncols=True)
            remaining = len(order)
            while remaining:
                for out in engine.step():
                    idx = order.get(out.request_id)
                    if idx is None or not isinstance(out, EmbeddingRequestOutput):
                        continue
                    if out.finish_reason != "stop":
                        raise RuntimeError(
                            f"embedding of prompt {idx} ended without a vector "
                            f"({out.finish_reason})"
                        )
                    results[idx] = out
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            engine.abort_request([r for r, i in order.items() if results[i] is None])
            raise
        return [r for r in results if r is not None]
