"""From what a caller sends to engine-core requests: tokenize, validate, fan out n.

This is the one validator: the offline `LLM`, `LLMEngine` and every HTTP endpoint hand
their requests to `InputProcessor.process`, and every problem with a request is found here
and raised as a ValueError naming it, before anything reaches the engine core: a bad
request must never surface later as a failed engine step. The core only asserts its own
invariants. A request with `n > 1` becomes `n` core requests over the same prompt; the
prefix cache shares the prompt's full blocks between them, so the copies cost little more
than their own generated tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagemill.runtime.engine.model_assets import eos_ids
from pagemill.runtime.engine.protocol import EngineCoreRequest
from pagemill.runtime.lora.request import LoRARequest
from pagemill.runtime.pooling_params import PoolingDefaults, PoolingParams
from pagemill.runtime.sample.structured_output.params import validate as validate_structured_output
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.tool_calling.prompt import render_chat


@dataclass(slots=True)
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    # One core request per completion; child parameters differ by seed.
    completions: list[EngineCoreRequest]


class _WithTemplateArgs:
    """A tokenizer whose chat template gets a request's extra arguments on every call (every
    way `render_chat` renders a conversation goes through `apply_chat_template`)."""

    def __init__(self, tokenizer: Any, extra: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._extra = extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(conversation, **{**self._extra, **kwargs})


# The sampling side of a pooling request: never sampled, one placeholder token ends it.
_POOLING_PLACEHOLDER = SamplingParams(temperature=0.0, max_tokens=1)


class InputProcessor:
    """Tokenization, chat templating and request validation; no model, no device.

    `default_max_tokens` (the model's generation config, if it sets one) is what a
    request without max_tokens gets, capped to the room its prompt leaves; without it such
    a request may fill the context.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        default_max_tokens: int | None = None,
        max_logprobs: int | None = None,
        runner: str = "auto",
        pooling_defaults: PoolingDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # "generate" refuses pooling requests, "pooling" refuses generation, "auto" serves both.
        self.runner = runner
        self.pooling_defaults = pooling_defaults or PoolingDefaults()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_ids(tokenizer, list(eos_token_ids))
        self.default_max_tokens = default_max_tokens
        self.max_logprobs = max_logprobs  # --max-logprobs; None: SamplingParams' own cap
        self._text_byte_limit: int | None = None

    def text_byte_limit(self) -> int:
        """Bytes of text past which a prompt can never fit the context, whatever it says.

        No token covers more text than its longest vocabulary entry (B bytes; 4x margin for
        normalizers), so a text of more than max_model_len x B x 4 bytes has more tokens
        than fit: refused without tokenizing it (a multi-megabyte prompt costs seconds of
        tokenizer time).
        """
        if self._text_byte_limit is None:
            longest = 16
            vocab = getattr(self.tokenizer, "get_vocab", None)
            if callable(vocab):
                longest = max((len(t.encode("utf-8", "replace")) for t in vocab()), default=16)
            self._text_byte_limit = self.max_model_len * max(longest, 1) * 4
        return self._text_byte_limit

    def check_text_size(self, text: str, what: str = "the prompt") -> None:
        size = len(text.encode("utf-8"))
        if size > self.text_byte_limit():
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens; {what} is {size} bytes, more than that many tokens "
                "can hold."
            )

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens` False: no BOS or other tokens the tokenizer adds itself."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        self.check_text_size(prompt)
        if add_special_tokens:
            return list(self.tokenizer.encode(prompt))
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a conversation through `chat_template` (a Jinja template), else the
        tokenizer's own.

        With `tools` (OpenAI function definitions), or messages carrying tool calls and
        tool results, see `tool_calling.render_chat`: a template that knows tools gets them
        as they are, one that does not gets them written in the Hermes format.
        `template_kwargs` are further variables of the template (vLLM's
        chat_template_kwargs, e.g. `enable_thinking`) and transformers' own template options
        (`continue_final_message`, `documents`). `add_special_tokens` adds the tokenizer's
        own (a BOS) on top of what the template writes: off by default, as vLLM's chat.
        """
        if self.tokenizer is None or not (
            chat_template or getattr(self.tokenizer, "chat_template", None)
        ):
            raise ValueError(
                "this model's tokenizer has no chat template; use generate() with a plain prompt"
            )
        tokenizer = self.tokenizer
        if template_kwargs:
            tokenizer = _WithTemplateArgs(tokenizer, dict(template_kwargs))
        text = render_chat(tokenizer, messages, add_generation_prompt, tools, chat_template)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        priority: int,
        cache_salt: str | None,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        if isinstance(params, PoolingParams):
            return self.process_pooling(
                request_id, prompt, params, priority=priority, arrival_time=arrival_time
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.runner == "pooling":
            raise ValueError(
                "this engine serves embeddings only (runner='pooling'); start it without "
                "--runner pooling / --convert embed to generate text"
            )
        text, prompt_ids = self._prompt_ids(prompt)
        limit = self.max_model_len
        keep = params.truncate_prompt_tokens
        if keep is not None:
            # vLLM's: the last k tokens (the end of a prompt is what the answer follows);
            # -1 keeps as many as the context holds with room for one generated token.
            keep = limit - 1 if keep == -1 else keep
            if len(prompt_ids) > keep:
                prompt_ids = prompt_ids[-keep:]
                text = None  # the text no longer says what the model reads
        n_prompt = len(prompt_ids)
        if n_prompt >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {n_prompt} tokens, which leaves no room for a completion: at most "
                f"max_model_len - 1 = {limit - 1} fit (one position is needed for the first "
                "generated token)."
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            room = limit - n_prompt
            max_tokens = (
                room if self.default_max_tokens is None else min(self.default_max_tokens, room)
            )
        elif n_prompt + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens: prompt ({n_prompt} "
                f"tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} exceeds "
                f"max_model_len={limit}. Please reduce the prompt or max_tokens (to at most "
                f"{limit - n_prompt})."
            )
        if params.min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})"
            )
        cap = self.max_logprobs
        if cap is not None and params.logprobs is not None and params.logprobs > cap:
            raise ValueError(
                f"SamplingParams.logprobs={params.logprobs} is more than this server allows "
                f"(--max-logprobs {cap})"
            )
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(
                    f"logit_bias token id(s) {bad[:5]} are outside the "
                    f"vocabulary (ids must be < {self.vocab_size})"
                )
        params = self._check_token_lists(params)
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
            if i and child.prompt_logprobs is not None:
                # The n completions share one prompt: its logprobs are computed once.
                child = dataclasses.replace(child, prompt_logprobs=None)
            # Extra EOS ids (Llama 3 lists several) act as stop tokens, unless EOS is ignored.
            stop_ids = list(child.stop_token_ids)
            if not child.ignore_eos:
                stop_ids += [t for t in eos[1:] if t not in stop_ids]
            completions.append(
                EngineCoreRequest(
                    child_id,
                    prompt_ids,
                    child,
                    max_tokens,
                    eos[0] if eos else None,
                    stop_ids,
                    arrival_time,
                    priority,
                    cache_salt,
                    lora_request=lora_request,
                )
            )
        return ProcessedRequest(text, prompt_ids, completions)

    def _check_token_lists(self, params: SamplingParams) -> SamplingParams:
        """allowed_token_ids and bad words in the vocabulary; bad words tokenized."""
        vocab = self.vocab_size
        if params.allowed_token_ids is not None:
            bad = sorted({t for t in params.allowed_token_ids if t >= vocab})
            if bad:
                raise ValueError(
                    f"allowed_token_ids {bad[:5]} are outside the vocabulary "
                    f"(ids must be < {vocab})"
                )
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this model folder has none")
            params = dataclasses.replace(
                params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words)
            )
        if params.bad_words_token_ids:
            bad = sorted({t for w in params.bad_words_token_ids for t in w if t >= vocab})
            if bad:
                raise ValueError(
                    f"bad_words encode to token ids {bad[:5]} outside the model's vocabulary "
                    f"(ids must be < {vocab})"
                )
        return params

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's token sequences, as vLLM forms them: the word as written, and with
        one leading space when that spelling is a different word of the same length (the
        form a word takes mid-sentence in BPE vocabularies)."""
        assert self.tokenizer is not None
        out: list[list[int]] = []
        for word in words:
            bare = word.lstrip()
            plain = list(self.tokenizer.encode(bare, add_special_tokens=False))
            if plain:
                out.append(plain)
            spaced = list(self.tokenizer.encode(" " + bare, add_special_tokens=False))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return out

    def process_pooling(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: PoolingParams,
        *,
        priority: int = 0,
        arrival_time: float,
    ) -> ProcessedRequest:
        """One embedding request: the prompt (truncated to its last
        `truncate_prompt_tokens` when asked, -1: to the context) and complete pooling
        parameters; a prompt may fill the whole context, since nothing is generated."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.runner == "generate":
            raise ValueError(
                "this engine serves text generation only (runner='generate'); start it with "
                "--runner pooling (or auto) to compute embeddings"
            )
        resolved = self.pooling_defaults.resolve(params)
        text, prompt_ids = self._prompt_ids(prompt)
        limit = self.max_model_len
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = limit
        if keep is not None:
            if keep > limit:
                raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={limit}")
            prompt_ids = prompt_ids[-keep:]
        if len(prompt_ids) > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt_ids)} tokens in the input for embedding generation. "
                "Please reduce the length of the input (or set truncate_prompt_tokens)."
            )
        request = EngineCoreRequest(
            request_id,
            prompt_ids,
            _POOLING_PLACEHOLDER,
            1,
            None,
            [],
            arrival_time,
            priority,
            None,
            resolved,
        )
        return ProcessedRequest(text, prompt_ids, [request])

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
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
            ]
            if bad:
                # An id past the embedding table would break the step, not just this request.
                raise ValueError(
                    f"prompt token ids must be ints in [0, {vocab}) (the vocabulary); got {bad[:5]}"
                )
        if not ids:
            raise ValueError("the prompt is empty (it encodes to no tokens)")
        return text, ids
