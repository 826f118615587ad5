"""Every field of vLLM's chat-completion and completion request bodies, and what pagemill
does with it: the one list a client (or a test) can read to know whether a field is honoured.

A client switching from vLLM sends vLLM's fields; silently dropping one would return output
that breaks what it asked for (a constraint not applied, a word not banned). So each field
is either implemented, or refused with a 400 naming it as soon as the client sets it to
anything but its default. Fields outside this list (and outside OpenAI's few deprecated
ones) are ignored with one warning per field name for the life of the process: that is
what the OpenAI SDK's `extra_body` users expect of a server that does not know a field.

The union of vLLM's releases is listed (the `guided_*` fields of older releases beside
`structured_outputs`), since clients written against either are in use.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["implemented", "refused", "elsewhere"]
Endpoint = Literal["chat", "completion"]
BOTH: tuple[Endpoint, ...] = ("chat", "completion")
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETION: tuple[Endpoint, ...] = ("completion",)


@dataclass(frozen=True)
class FieldSupport:
    status: Status
    note: str
    """Implemented: what honours it. Refused: why (the 400's words)."""
    endpoints: tuple[Endpoint, ...] = BOTH
    default: Any = None
    """The value a client may always send: a refused field set to it is not refused."""
    example: Any = None
    """A value that is not the default (what a test sends to see the field's effect or
    its 400)."""


def _impl(note: str, endpoints: tuple[Endpoint, ...] = BOTH) -> FieldSupport:
    return FieldSupport("implemented", note, endpoints)


def _refuse(
    note: str, example: Any, endpoints: tuple[Endpoint, ...] = BOTH, default: Any = None
) -> FieldSupport:
    return FieldSupport("refused", note, endpoints, default, example)


FIELDS: dict[str, FieldSupport] = {
    # OpenAI's fields
    "model": _impl("checked against the served model names (404 otherwise)"),
    "messages": _impl("rendered through the chat template", CHAT),
    "prompt": _impl("text, token ids, or a batch of either", COMPLETION),
    "frequency_penalty": _impl("sampler"),
    "presence_penalty": _impl("sampler"),
    "logit_bias": _impl("sampler (ids checked against the vocabulary)"),
    "logprobs": _impl("sampled token's logprob and top-n"),
    "top_logprobs": _impl("top-n logprobs per token", CHAT),
    "max_tokens": _impl("engine (the rest of the context when unset, chat)"),
    "max_completion_tokens": _impl("as max_tokens", CHAT),
    "n": _impl("n engine requests over one shared prompt"),
    "best_of": _impl(
        "equal to n (or unset); no server keeps more candidates than it returns",
        COMPLETION,
    ),
    "echo": _impl(
        "completions: the prompt before the output (not with logprobs until prompt "
        "logprobs exist); chat: the final message's text before the reply when that "
        "message is the assistant's"
    ),
    "response_format": _impl("structured output (json_object, json_schema)"),
    "seed": _impl("per-request generator"),
    "stop": _impl("stop strings (front end)"),
    "stream": _impl("server-sent events"),
    "stream_options": _impl("include_usage, continuous_usage_stats"),
    "suffix": FieldSupport(
        "refused",
        "fill-in-the-middle needs a model-specific prompt format, which this server does not know",
        COMPLETION,
        None,
        "tail",
    ),
    "temperature": _impl("sampler"),
    "top_p": _impl("sampler"),
    "tools": _impl("chat template and tool parser", CHAT),
    "tool_choice": _impl("none, auto, required, or a named function", CHAT),
    "parallel_tool_calls": _impl("tool parser", CHAT),
    "user": _impl("accepted as a label; it changes no output (OpenAI's and vLLM's too)"),
    "reasoning_effort": _impl(
        "passed to the chat template as `reasoning_effort`, as vLLM does", CHAT
    ),
    "include_reasoning": _impl(
        "false leaves the reasoning split off by --reasoning-parser out of the reply", CHAT
    ),
    "thinking_token_budget": _refuse("a reasoning budget is not supported", 64, CHAT),
    "prompt_embeds": _refuse(
        "prompts are text or token ids here; embeddings as input are not supported",
        "AAAA",
        COMPLETION,
    ),
    # vLLM's sampling extras
    "use_beam_search": _refuse("beam search is not supported", True, default=False),
    "length_penalty": _refuse(
        "applies to beam search only, which is not supported", 0.5, default=1.0
    ),
    "watermarking": _refuse("watermarking is not supported", True, default=False),
    "top_k": _impl("sampler"),
    "min_p": _impl("sampler"),
    "repetition_penalty": _impl("sampler (prompt and output tokens)"),
    "stop_token_ids": _impl("engine stops on them"),
    "include_stop_str_in_output": _impl("front end"),
    "ignore_eos": _impl("engine"),
    "min_tokens": _impl("sampler bans EOS and stop tokens until then"),
    "skip_special_tokens": _impl("detokenizer"),
    "spaces_between_special_tokens": _refuse(
        "special tokens are always decoded as the tokenizer joins them",
        False,
        default=True,
    ),
    "truncate_prompt_tokens": _impl("input processor keeps the last k prompt tokens"),
    "truncation_side": _refuse(
        "prompts are truncated from the left (the last tokens kept) only",
        "right",
        default="left",
    ),
    "prompt_logprobs": FieldSupport("elsewhere", "prompt logprobs (engine and server)"),
    "logprob_token_ids": _refuse(
        "logprobs of chosen ids are not supported; use logprobs/top_logprobs", [1]
    ),
    "allowed_token_ids": _impl("sampler mask (ids checked against the vocabulary)"),
    "bad_words": _impl("sampler bans a word's last token once its prefix is generated"),
    # vLLM's extra parameters
    "add_generation_prompt": _impl("chat template", CHAT),
    "continue_final_message": _impl("chat template leaves the final message open", CHAT),
    "add_special_tokens": _impl("tokenizer (BOS and the like)"),
    "documents": _impl("passed to the chat template", CHAT),
    "chat_template": _refuse(
        "a request's own Jinja template is not run by this server; start it with --chat-template",
        "{{ messages }}",
        CHAT,
    ),
    "chat_template_kwargs": _impl("passed to the chat template", CHAT),
    "media_io_kwargs": _refuse("multimodal input is not supported", {"image": {}}, CHAT),
    "mm_processor_kwargs": _refuse("multimodal input is not supported", {"x": 1}, CHAT),
    "structured_outputs": _impl("grammar-constrained decoding"),
    "guided_json": _impl("alias of structured_outputs.json"),
    "guided_regex": _impl("alias of structured_outputs.regex"),
    "guided_choice": _impl("alias of structured_outputs.choice"),
    "guided_grammar": _impl("alias of structured_outputs.grammar"),
    "guided_decoding_backend": _impl(
        "'xgrammar' or 'auto' (this server's one backend); any other backend is a 400"
    ),
    "guided_whitespace_pattern": _refuse(
        "a custom JSON whitespace pattern is not supported; use "
        "structured_outputs.disable_any_whitespace",
        r"[ ]?",
    ),
    "structural_tag": _refuse("structural tags are not supported", "{}"),
    "priority": _impl("scheduler (lower runs first)"),
    "request_id": _impl("the response's id is built from it"),
    "session_id": _impl("accepted as a label for routers; it changes no output", CHAT),
    "logits_processors": _refuse("custom logits processors are not loaded", ["x.y"]),
    "return_tokens_as_token_ids": _impl("logprob tokens written `token_id:<id>`"),
    "return_token_ids": _refuse("token ids are not returned", True, default=False),
    "return_token_offsets": _refuse("token offsets are not returned", True, default=False),
    "return_prompt_text": _refuse(
        "the rendered prompt is not returned; use /tokenize", True, CHAT, default=False
    ),
    "return_mm_kwargs": _refuse("multimodal input is not supported", False, CHAT, default=True),
    "routed_experts_prompt_start": _refuse("expert routing data is not returned", 1, default=0),
    "cache_salt": _impl("prefix cache salted per tenant"),
    "kv_transfer_params": _refuse("disaggregated serving is not supported", {"x": 1}),
    "ec_transfer_params": _refuse("disaggregated serving is not supported", {"x": 1}, CHAT),
    "vllm_xargs": _refuse("no extension reads custom arguments here", {"x": 1}),
    "repetition_detection": _refuse("repetition detection is not supported", {"x": 1}),
    "stream_interval": _refuse(
        "every step's tokens are streamed as they come (an interval of 1)", 4, default=1
    ),
}

# OpenAI's deprecated names for what tools do: refused, pointing at the current ones.
OPENAI_DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}

# stream_options' own fields (nested: not in the table above's top level).
STREAM_OPTIONS_FIELDS = {
    "include_usage": _impl("a last chunk with the usage"),
    "continuous_usage_stats": _impl("the usage so far in every chunk"),
}


def fields_for(endpoint: Endpoint) -> dict[str, FieldSupport]:
    return {name: f for name, f in FIELDS.items() if endpoint in f.endpoints}


def refusal(endpoint: Endpoint, name: str, value: Any) -> str | None:
    """Why `name` = `value` is refused on `endpoint`, or None when it is not."""
    f = FIELDS.get(name)
    if f is None or f.status != "refused" or endpoint not in f.endpoints:
        return None
    if value is None or value == f.default:
        return None
    return f"'{name}' is not supported by this server: {f.note}"


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_unknown(names: set[str]) -> list[str]:
    """Log each unknown field name the first time any request sends it; returns the names
    warned about now."""
    with _warned_lock:
        new = sorted(names - _warned)
        _warned.update(new)
    for name in new:
        logger.warning(
            "request field %r is not one this server knows (OpenAI's or vLLM's); it is "
            "ignored (this is logged once per field name)",
            name,
        )
    return new
