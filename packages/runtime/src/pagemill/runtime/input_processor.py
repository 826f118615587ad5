"""From what a caller sends to the scheduler's request records: tokenize, validate, fan out n.

Every problem with a request is found here and raised as a ValueError naming it, before
anything is queued: a bad request must never surface later as a failed engine step. A
request with `n > 1` becomes `n` records over the same prompt; the prefix cache shares
the prompt's full blocks between them, so the copies cost little more than their own
generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagemill.scheduler import Request

from .sampling_params import SamplingParams
from .structured_output.params import validate as validate_structured_output
from .tool_calling.prompt import render_chat


@dataclass(slots=True)
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    # One (record, its own parameters) per completion; child parameters differ by seed.
    completions: list[tuple[Request, SamplingParams]]


class InputProcessor:
    """Tokenization, chat templating and request validation; no model, no device."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = self.eos_ids(tokenizer, eos_token_ids)

    @staticmethod
    def eos_ids(tokenizer: Any | None, eos_token_ids: Sequence[int]) -> list[int]:
        """The model's EOS ids, then the tokenizer's own if it is not among them."""
        eos = list(eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in eos:
            eos.append(tok_eos)
        return eos

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            chat_template: str | None = None,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation through `chat_template` (a Jinja template), else the
        tokenizer's own.

        With `tools` (OpenAI function definitions), or messages carrying tool calls and
        tool results, see `tool_calling.render_chat`: a template that knows tools gets them
        as they are, one that does not gets them written in the Hermes format.
        """
        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        text = render_chat(self.tokenizer, messages, add_generation_prompt, tools, chat_template)
        # The template already writes every special token it wants; don't add a second BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                priority: int, cache_salt: str | None, arrival_time: float) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        text, prompt_ids = self._prompt_ids(prompt)
        n_prompt = len(prompt_ids)
        if n_prompt > self.max_model_len - 1:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; at most max_model_len - 1 = {self.max_model_len - 1} "
                "fit (one position is needed for the first generated token)"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        elif n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                f"exceeds max_model_len={self.max_model_len}; lower max_tokens to at most "
                f"{self.max_model_len - n_prompt}"
            )
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens that fit")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(f"logit_bias token id(s) {bad[:5]} are outside the "
                                 f"vocabulary (ids must be < {self.vocab_size})")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer, and this model folder has none")
        if params.structured_outputs is not None:
            validate_structured_output(params.structured_outputs)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none")
        eos = self.eos_token_ids
        ids = [request_id] if params.n == 1 else [f"{request_id}[{i}]" for i in range(params.n)]
        completions = []
        for i, child_id in enumerate(ids):
            child = params if params.n == 1 else params.child_params(i)
            # Extra EOS ids (Llama 3 lists several) act as stop tokens, unless EOS is ignored.
            stop_ids = list(child.stop_token_ids)
            if not child.ignore_eos:
                stop_ids += [t for t in eos[1:] if t not in stop_ids]
            record = Request(
                child_id,
                prompt_ids,
                max_tokens=max_tokens,
                min_tokens=child.min_tokens,
                eos_token_id=eos[0] if eos else None,
                stop_token_ids=stop_ids,
                ignore_eos=child.ignore_eos,
                priority=priority,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                sampling_params=child,
            )
            completions.append((record, child))
        return ProcessedRequest(text, prompt_ids, completions)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            ids = self.encode(prompt)
            text: str | None = prompt
        else:
            text = None
            ids = list(prompt)
            vocab = self.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty (it encodes to no tokens)")
        return text, ids
