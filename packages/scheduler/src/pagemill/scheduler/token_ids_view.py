"""Read-only windows onto a request's one token list.

A request keeps prompt and output in a single `all_token_ids` list (the list the block
hasher and the runner read). The prompt and the output are views over it rather than
second lists, so there is nothing to keep in sync and appending a token stays one append.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import overload


class TokenIdsView(Sequence[int]):
    """`tokens[start:stop]` without the copy; `stop=None` follows the list as it grows.

    Slicing returns a plain list (a copy of just that slice), so callers that need to keep
    tokens get a snapshot, while callers that keep the view see later tokens.
    """

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: list[int], start: int = 0, stop: int | None = None) -> None:
        self._tokens = tokens
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        n = len(self._tokens)
        return n if self._stop is None or self._stop > n else self._stop

    def __len__(self) -> int:
        return max(0, self._end() - self._start)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            positions = range(self._start, max(self._start, self._end()))[index]
            if positions.step > 0:
                return self._tokens[positions.start : positions.stop : positions.step]
            return [self._tokens[p] for p in positions]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("token index out of range")
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return islice(self._tokens, self._start, self._end())

    def __eq__(self, other: object) -> bool:
        # Equal to any sequence of the same ints (list, tuple, another view), never to str.
        if isinstance(other, str | bytes) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # its contents change as the request grows

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"
