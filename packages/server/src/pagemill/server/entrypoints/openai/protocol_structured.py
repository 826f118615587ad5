"""Wire shapes of structured output, tools and /tokenize (OpenAI's and vLLM's).

Kept apart from protocol.py, which only gains the fields that use these: the request
models of completions and chat stay one screen each.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagemill.server.entrypoints.openai.limits import STRICT


class _Model(BaseModel):
    model_config = STRICT  # request bodies: no coercion between JSON types (see protocol)


class StructuredOutputsField(_Model):
    """vLLM's `structured_outputs` (and its older `guided_*` fields under these names)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(**STRICT, populate_by_name=True)


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(**STRICT, populate_by_name=True)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError(
                "response_format of type 'json_schema' needs "
                "'json_schema': {'name': ..., 'schema': {...}}"
            )
        return self


# Arguments of the template call itself: chat_template_kwargs may not override them.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)

# OpenAI's rule for function (tool) names.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Model):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Model):
    name: str
    arguments: str = "{}"


class ToolCallMessage(_Model):
    """A call as it comes back in an assistant message, or goes out in a response."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# ---------------------------------------------------------------- /tokenize, /detokenize


class TokenizeRequest(_Model):
    """vLLM's: either a `prompt` or chat `messages` (then templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.prompt is not None and (self.continue_final_message or self.chat_template_kwargs):
            raise ValueError(
                "'continue_final_message' and 'chat_template_kwargs' apply to 'messages' only"
            )
        if self.continue_final_message:
            if "add_generation_prompt" not in self.model_fields_set:
                self.add_generation_prompt = False
            elif self.add_generation_prompt:
                raise ValueError(
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true"
                )
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"'chat_template_kwargs' may not set {taken}: the server sets them")
        return kwargs

    @property
    def template_kwargs(self) -> dict[str, Any]:
        extra = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            extra["continue_final_message"] = True
        return extra


class TokenizeResponse(BaseModel):  # a response: built here, not validated strictly
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):  # a response: built here, not validated strictly
    prompt: str
