"""The README's embedding example runs as written and never loads torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

RUNNER = (
    "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
    "assert 'torch' not in sys.modules, 'pagemill.scheduler must not import torch'"
)


def test_readme_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "too-long finished (ignored)" in lines[0]
    finished = {line.split(": ")[1].split()[0] for line in lines[:-1]}
    assert finished == {"too-long", *(f"req-{i}" for i in range(6))}
    assert re.fullmatch(r"\d+ steps, \d+ preemptions, prefix-cache hit rate 0\.\d\d", lines[-1])
