"""Reading checkpoint tensors from a Hugging Face folder of safetensors files.

Files are memory-mapped through `safetensors.safe_open` and tensors are read one at a
time, so loading never holds a second full copy of the checkpoint in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's files: from the shard index when there is one, else every *.safetensors.

    Raises with the folder's actual content when there are no weights, so a wrong path or a
    PyTorch-only (.bin) checkpoint is recognisable from the message.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} lists shard(s) missing from {folder}: {', '.join(missing)}"
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        hint = (
            " (PyTorch .bin checkpoints are not supported; convert to safetensors)"
            if any(n.endswith(".bin") for n in present)
            else ""
        )
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}{hint}; "
            f"folder holds: {', '.join(present) or 'nothing'}"
        )
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over every file of the checkpoint, lazily and memory-mapped."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                yield name, f.get_tensor(name)
