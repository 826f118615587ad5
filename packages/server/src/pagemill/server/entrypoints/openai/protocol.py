"""The OpenAI wire format: request bodies (validated here) and response bodies.

Requests are validated by pydantic so that every malformed field becomes a 400 that names
the field (see errors.py); cross-field rules and features we do not implement are refused
here too, rather than silently ignored, so a client never gets an answer to a question it
did not ask. Every field of vLLM's request bodies is declared here and listed, with what
honours it or why it is refused, in request_fields.py; any other field is ignored with one
warning per field name (OpenAI clients send fields like `store`).

Request bodies are strict (`STRICT`): JSON's types are taken as they are, so `true` is not
the integer 1 (nor a token id), `"yes"` is not a boolean, and floats must be finite; a
number may stand for a float. Strings must be valid Unicode: a lone UTF-16 surrogate
(`"\ud800"`, which JSON can spell) is refused with the field it is in.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagemill.server.entrypoints.openai.limits import (
    MAX_CHOICES_PER_REQUEST,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    STRICT,
    find_lone_surrogate,
)
from pagemill.server.entrypoints.openai.protocol_structured import (
    TEMPLATE_ARGUMENTS,
    ChatTool,
    ResponseFormat,
    StructuredOutputsField,
    ToolCallMessage,
    ToolChoice,
)
from pagemill.server.entrypoints.openai.request_fields import (
    OPENAI_DEPRECATED,
    Endpoint,
    refusal,
    warn_unknown,
)

# OpenAI's own caps: top logprobs per position and the number of stop strings.
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 128

NonNegInt = Annotated[int, Field(ge=0)]
# Request priority (vLLM's: lower runs first), bounded to a 32-bit integer.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1

# Each request model's field names and aliases: what is not among them is unknown.
_KNOWN_NAMES: dict[type, frozenset[str]] = {}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    model_config = STRICT
    # vLLM's default: sending stream_options at all asks for the usage chunk.
    include_usage: bool = True
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = {f"stream_options.{k}" for k in data if k not in cls.model_fields}
            if unknown:
                warn_unknown(unknown)
        return data


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat: OpenAI's plus vLLM's extras."""

    model_config = STRICT
    ENDPOINT: ClassVar[Endpoint] = "completion"

    @model_validator(mode="before")
    @classmethod
    def _unknown_and_deprecated(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, instead in OPENAI_DEPRECATED.items():
                if data.get(name) is not None:
                    raise ValueError(f"'{name}' is not supported by this server; use {instead}")
            known = _KNOWN_NAMES.get(cls)
            if known is None:
                known = frozenset(cls.model_fields) | {
                    f.alias for f in cls.model_fields.values() if f.alias
                }
                _KNOWN_NAMES[cls] = known
            unknown = {k for k in data if isinstance(k, str) and k not in known}
            if unknown:
                warn_unknown(unknown)
        return data

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    # null means the default for these, as in vLLM (clients send it).
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    response_format: ResponseFormat | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    allowed_token_ids: list[NonNegInt] | None = None
    bad_words: list[str] | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's own default (vLLM's)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    echo: bool = False
    return_tokens_as_token_ids: bool | None = None
    # vLLM's older names for structured_outputs' constraints.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Refused unless sent as their default (request_fields.py says why): declared so that
    # the 400 names the field.
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    spaces_between_special_tokens: Any = None
    truncation_side: Any = None
    logprob_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    return_token_ids: Any = None
    return_token_offsets: Any = None
    routed_experts_prompt_start: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    stream_interval: Any = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("*", mode="before")
    @classmethod
    def _check_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        refused = refusal(cls.ENDPOINT, info.field_name or "", data)
        if refused is not None:
            raise ValueError(refused)
        where = find_lone_surrogate(data, info.field_name or "")
        if where is not None:
            raise ValueError(
                f"'{where}' contains a lone UTF-16 surrogate, which is not valid Unicode text"
            )
        return data

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' takes at most {MAX_STOP_STRINGS} strings")
        if any(not s for s in stops):
            raise ValueError("'stop' strings must be non-empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("'cache_salt' must be a non-empty string")
        if self.prompt_logprobs is not None and self.stream:  # vLLM refuses it too
            raise ValueError("'prompt_logprobs' are not available when 'stream' is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def tokens_as_ids(self) -> bool:
        return bool(self.return_tokens_as_token_ids)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None
    prompt_embeds: Any = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, p: PromptType) -> PromptType:
        if isinstance(p, list):
            if not p:
                raise ValueError("'prompt' must not be empty")
            if any(isinstance(x, list) and not x for x in p):
                raise ValueError("'prompt' token lists must not be empty")
            if any(isinstance(x, int) and x < 0 for x in p) or any(
                isinstance(x, list) and any(t < 0 for t in x) for x in p
            ):
                raise ValueError("'prompt' token ids must be non-negative")
        return p

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "'echo' with 'logprobs' (the prompt's tokens in the logprobs) is not "
                "supported; send one of them (prompt_logprobs gives the prompt's logprobs)"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("'best_of' must be at least n")
        if self.best_of is not None and self.best_of > self.n:
            raise ValueError(
                "'best_of' greater than n is not supported: this server returns every "
                "completion it generates (send n instead)"
            )
        choices = len(self.prompts()) * self.n
        if choices > MAX_CHOICES_PER_REQUEST:
            raise ValueError(
                f"this request asks for {choices} completions (prompts x n); at "
                f"most {MAX_CHOICES_PER_REQUEST} are allowed per request"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a batch: OpenAI accepts one string, strings, ids, or lists of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(OpenAIModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    ENDPOINT: ClassVar[Endpoint] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    session_id: str | None = None
    # False: the reasoning is generated but left out of the reply (vLLM's include_reasoning).
    include_reasoning: bool = True
    # Refused unless sent as their default (see request_fields.py).
    thinking_token_budget: Any = None
    chat_template: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None
    return_mm_kwargs: Any = None
    ec_transfer_params: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(
                f"'chat_template_kwargs' may not set {taken}: the server sets them (use the "
                "request fields of those names where there are any)"
            )
        return kwargs

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                # vLLM refuses only both set explicitly; unset, the prompt stays open.
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise ValueError(
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true"
                )
            if self.messages[-1].role != "assistant":
                raise ValueError(
                    "'continue_final_message' needs the last message to be the assistant's"
                )
        return self

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets beyond the messages, tools and generation prompt."""
        extra: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            extra["documents"] = self.documents
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        if self.continue_final_message:
            extra["continue_final_message"] = True
        return extra

    @property
    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's `Logprob` as its responses spell it (`prompt_logprobs` entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (None for the first): {token id: its logprob}, vLLM's shape.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # --reasoning-parser: the thinking, under vLLM's older and newer names.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallMessage] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagemill"
    root: str | None = None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
