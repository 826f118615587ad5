"""Split GGUF files (llama.cpp's `gguf-split`): `name-00001-of-00003.gguf` and its siblings.

Every shard is a GGUF file with `split.no` (0-based), `split.count` and
`split.tensors.count` in its metadata; the first also holds the model's metadata (the
architecture, the tokenizer), the tensors are spread over all of them. Given any shard (or
the folder holding one split model), `gguf_shards` lists all of them in order and checks
that the set is complete; `GGUFShards` reads their tensors as one checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.gguf_blocks import RequantError

# llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf", shards counted from 1.
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)


def shard_name(prefix: str, no: int, count: int) -> str:
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def _split_fields(reader: Any) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of one open shard, None if not split."""
    count = reader.fields.get("split.count")
    if count is None or int(count.contents()) <= 1:
        return None
    no = reader.fields.get("split.no")
    total = reader.fields.get("split.tensors.count")
    return (
        int(no.contents()) if no is not None else -1,
        int(count.contents()),
        int(total.contents()) if total is not None else -1,
    )


def gguf_shards(path: Path, reader: Any | None = None) -> list[Path]:
    """All files of the model `path` belongs to: `[path]` for a plain GGUF, every shard
    of a split one (first first); a missing shard is an error naming it."""
    import gguf

    if reader is None:
        reader = gguf.GGUFReader(str(path))
    split = _split_fields(reader)
    if split is None:
        return [path]
    no, count, _ = split
    match = SHARD_NAME.match(path.name)
    if match is None or int(match["count"]) != count or int(match["no"]) != no + 1:
        raise ValueError(
            f"{path.name} is shard {no + 1} of a {count}-file split GGUF but is not named "
            f"like one (expected PREFIX-{no + 1:05d}-of-{count:05d}.gguf, as gguf-split names "
            f"them), so its other shards cannot be found"
        )
    names = [shard_name(match["prefix"], i, count) for i in range(1, count + 1)]
    missing = [n for n in names if not (path.parent / n).is_file()]
    if missing:
        raise ValueError(
            f"split GGUF {names[0]} has {count} shards but {len(missing)} of them are missing "
            f"from {path.parent}: {', '.join(missing)}"
        )
    return [path.parent / n for n in names]


def check_shards(paths: list[Path], readers: list[Any]) -> None:
    """Each shard says it is the shard its name says, of the same split; tensors add up."""
    if len(paths) == 1:
        return
    declared, found = -1, 0
    for i, (path, reader) in enumerate(zip(paths, readers)):
        split = _split_fields(reader)
        if split is None or split[0] != i or split[1] != len(paths):
            raise ValueError(
                f"{path.name} is not shard {i + 1} of {len(paths)} (its split.no / split.count "
                f"say {split[:2] if split else 'not split'})"
            )
        declared = split[2] if declared < 0 else declared
        found += len(reader.tensors)
    if declared >= 0 and found != declared:
        raise ValueError(
            f"split GGUF {paths[0].name}: its shards hold {found} tensors, split.tensors.count "
            f"says {declared} (a shard from another split?)"
        )


def gguf_in_folder(folder: Path) -> Path | None:
    """The one GGUF model in a folder without config.json (its file, or its first shard),
    None if there is no .gguf; several models are an error listing them."""
    files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if not files:
        return None
    models: dict[str, Path] = {}
    for p in files:  # sorted: a split model's first shard comes first
        match = SHARD_NAME.match(p.name)
        models.setdefault(f"{match['prefix']}-*-of-{match['count']}" if match else p.name, p)
    if len(models) > 1:
        raise ValueError(
            f"{folder} holds several GGUF models ({', '.join(sorted(models))}); pass the .gguf "
            f"file to serve"
        )
    return next(iter(models.values()))


class GGUFShards:
    """The tensors of a split GGUF, one `GGUFCheckpoint` per shard; the shards after the
    first carry no architecture, so the first's is given to them."""

    def __init__(self, paths: list[Path], index_file: Path | None = None) -> None:
        first = GGUFCheckpoint(paths[0], index_file=index_file)
        self.path = paths[0]
        self.architecture = first.architecture
        self.block_count = first.block_count
        self.shards = [first] + [
            GGUFCheckpoint(
                p,
                index_file=None if index_file is None else f"{index_file}.{i}",
                architecture=first.architecture,
                block_count=first.block_count,
            )
            for i, p in enumerate(paths[1:], start=2)
        ]

    def tensor_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for shard in self.shards:
            for name, n in shard.tensor_types().items():
                counts[name] = counts.get(name, 0) + n
        return counts

    @property
    def requant_errors(self) -> dict[str, RequantError]:
        """All shards' requantization errors together, per GGML type."""
        out: dict[str, RequantError] = {}
        for shard in self.shards:
            for qtype, err in shard.requant_errors.items():
                total = out.setdefault(qtype, RequantError(served_as=err.served_as))
                total.max_abs = max(total.max_abs, err.max_abs)
                total.sum_abs += err.sum_abs
                total.count += err.count
        return out

    def weights(
        self,
        names: Iterable[str],
        config: ModelConfig,
        *,
        requantize: bool = True,
        dense_dtype: torch.dtype = torch.float32,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        names = list(names)
        for shard in self.shards:
            yield from shard.weights(names, config, requantize=requantize, dense_dtype=dense_dtype)


def shards_by_name(path: Path) -> list[Path]:
    """The shards of a split GGUF from its file name alone (no parse: `gguf_shards`
    checked the set when the model was prepared), `[path]` for any other file."""
    match = SHARD_NAME.match(path.name)
    if match is None or int(match["count"]) <= 1:
        return [path]
    count = int(match["count"])
    paths = [path.parent / shard_name(match["prefix"], i, count) for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"split GGUF {paths[0].name}: shard(s) missing: {', '.join(missing)}")
    return paths


def open_gguf_checkpoint(path: Path, index_file: Path | None = None) -> Any:
    """`GGUFCheckpoint` for a plain GGUF, `GGUFShards` for (any shard of) a split one."""
    shards = shards_by_name(Path(path))
    if len(shards) == 1:
        return GGUFCheckpoint(path, index_file=index_file)
    return GGUFShards(shards, index_file)
