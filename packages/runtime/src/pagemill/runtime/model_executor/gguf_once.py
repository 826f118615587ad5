"""One parse of a GGUF file's header while a model folder is made from it.

`gguf.GGUFReader` parses every metadata field in Python: for a model with a 49k-token
vocabulary and its merges, seconds. Making the folder (transformers' config loader,
its tokenizer loader, the tensor table the engine reads) constructed a reader of the same
file three times, on the critical path of a first start. Inside `parsed_once(path)` every
`gguf.GGUFReader(path)` in the process returns one reader of that file; any other file, or
a reader asked for with other arguments, is parsed as usual. The readers are only read.

transformers imports `GGUFReader` from `gguf` at each call, so the module attribute is the
one seam; it is restored when the last `parsed_once` ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_readers: dict[Path, list[Any]] = {}  # file -> [its reader or None, open contexts]
_original: Any = None  # gguf.GGUFReader while it is replaced


def _key(path: Any) -> Path | None:
    try:
        return Path(path).resolve()
    except (TypeError, OSError):
        return None


def _shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
    key = None if args or kwargs else _key(path)
    with _lock:
        entry = _readers.get(key) if key is not None else None
        original = _original
        if entry is not None:
            if entry[0] is None:
                entry[0] = original(path)
            return entry[0]
    return original(path, *args, **kwargs)


@contextlib.contextmanager
def parsed_once(path: str | Path) -> Iterator[None]:
    """While open, `gguf.GGUFReader(path)` returns one shared reader (made at first use)."""
    import gguf

    global _original
    key = Path(path).resolve()
    with _lock:
        if _original is None:
            _original = gguf.GGUFReader
            gguf.GGUFReader = _shared_reader  # type: ignore[misc,assignment]
        entry = _readers.setdefault(key, [None, 0])
        entry[1] += 1
    try:
        yield
    finally:
        with _lock:
            entry[1] -= 1
            if entry[1] == 0:
                del _readers[key]
            if not _readers:
                gguf.GGUFReader = _original  # type: ignore[misc]
                _original = None
