"""POST /tokenize and /detokenize, in vLLM's shapes: the server's own tokenizer and chat
template, so a client can count tokens exactly as the engine will."""

from __future__ import annotations

from typing import Any

from pagemill.server.entrypoints.openai.errors import APIError, internal_error
from pagemill.server.entrypoints.openai.protocol_structured import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagemill.server.entrypoints.openai.serving_base import ServingBase
from pagemill.server.entrypoints.openai.serving_chat import special_token_pattern


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


class TokenizeServing(ServingBase):
    """Chat's rules hold here too: the same size cap, and no special-token strings in
    message content unless the server allows them in chat."""

    def __init__(self, *args: Any, allow_special_tokens: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._special = None if allow_special_tokens else special_token_pattern(self.tokenizer)

    def _check_messages(self, messages: list[dict[str, Any]]) -> None:
        texts = [_content_text(m.get("content")) for m in messages]
        self.check_text_size("".join(texts), "messages")
        if self._special is not None:
            for i, text in enumerate(texts):
                found = self._special.search(text)
                if found:
                    raise APIError(
                        400,
                        f"messages[{i}].content contains the special token "
                        f"{found.group()!r}, which chat refuses (the server "
                        "allows these only when started with "
                        "--allow-special-tokens-in-chat)",
                        param="messages",
                        code="special_token_in_content",
                    )

    def _tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        tok = self._require_tokenizer()
        if req.messages is not None:
            self._check_messages(req.messages)
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
            try:
                # The template writes its own special tokens (vLLM's default for messages).
                ids = self.client.input_processor.apply_chat_template(
                    req.messages,
                    req.add_generation_prompt,
                    tools=tools,
                    template_kwargs=req.template_kwargs,
                    add_special_tokens=bool(req.add_special_tokens),
                )
            except Exception as exc:  # as in chat: the template's own words, else generic
                if req.continue_final_message and isinstance(exc, ValueError):
                    raise APIError(
                        400,
                        f"continue_final_message: {str(exc)[:300]}",
                        param="continue_final_message",
                    ) from exc
                if type(exc).__module__.startswith("jinja2"):
                    raise APIError(
                        400,
                        f"the chat template refused these messages: {str(exc)[:300]}",
                        param="messages",
                    ) from exc
                raise internal_error(
                    400, "the chat template could not render these messages", exc
                ) from exc
        else:
            text = req.prompt or ""
            self.check_text_size(text, "prompt")
            ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens is not False))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def _detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        tok = self._require_tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_limit]
        if bad:
            raise APIError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary (ids 0..{self.vocab_limit - 1})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=tok.decode(req.tokens))

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        return await self.off_loop(self._tokenize, req)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        return await self.off_loop(self._detokenize, req)
