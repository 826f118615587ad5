"""The README's embedding example runs as written (on CPU: the torch paths)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_embedding_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## Embedding example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)
    assert capsys.readouterr().out.strip() == "torch.Size([4, 4, 32])"
    out = namespace["out"]
    assert isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())
