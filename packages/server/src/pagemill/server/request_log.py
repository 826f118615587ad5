"""`--enable-log-requests`: one log line per accepted request, as vLLM's request logger.

Off by default (vLLM's default too): prompts are the users' data. `--max-log-len` caps the
characters (or token ids) of the prompt written, vLLM's meaning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("pagemill.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log(self, request_id: str, prompt: str | Sequence[int], params: Any) -> None:
        cut = self.max_log_len
        if isinstance(prompt, str):
            shown: Any = prompt if cut is None else prompt[:cut]
            logger.info("received request %s: prompt: %r, params: %s", request_id, shown, params)
        else:
            ids = list(prompt)
            shown = ids if cut is None else ids[:cut]
            logger.info(
                "received request %s: prompt_token_ids: %s (%d tokens), params: %s",
                request_id,
                shown,
                len(ids),
                params,
            )
