"""The stop rules on token ids, in one place.

Applied once per sampled token, right after it is appended, by whoever appends it (the
scheduler's update_from_output). Stop strings are not here: they need detokenized text, which
the scheduler never sees; the engine ends such requests through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from pagemill.scheduler.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def check_stop(
    request: Request, max_model_len: int, pool_capacity_tokens: int
) -> RequestStatus | None:
    """The terminal status the request's last token puts it in, or None to keep going.

    A natural stop (EOS unless `ignore_eos`, or a stop token id, which is recorded in
    `request.stop_reason`) counts only once `min_tokens` outputs exist, and wins over the
    length caps when both apply to the same token. Length: `max_tokens` outputs, or
    `max_model_len` tokens in all, or more tokens than the whole KV pool can hold (the
    request could never be scheduled again).
    """
    tokens = request.all_token_ids
    num_tokens = len(tokens)
    num_output = num_tokens - request.num_prompt_tokens
    if num_output >= request.min_tokens:
        token = tokens[-1]
        if token == request.eos_token_id and not request.ignore_eos:
            return _STOPPED
        if token in request.stop_token_ids:
            request.stop_reason = token
            return _STOPPED
    max_tokens = request.max_tokens
    if (
        (max_tokens is not None and num_output >= max_tokens)
        or num_tokens >= max_model_len
        or num_tokens > pool_capacity_tokens
    ):
        return _CAPPED
    return None
