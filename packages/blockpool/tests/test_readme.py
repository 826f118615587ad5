"""The README's embedding example runs, prints what the README says, and never loads torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

RUNNER = (
    "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
    "assert 'torch' not in sys.modules, 'pagemill.blockpool must not import torch'"
)


def test_readme_example_runs_and_matches_its_output(tmp_path: Path) -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    outputs = re.findall(r"Prints \(on a machine without a GPU\):\n\n```\n(.*?)```", text, re.S)
    assert blocks and outputs
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    if "backend=cupy" in proc.stdout:
        pytest.skip("the README output is written for the NumPy backend")
    assert proc.stdout == outputs[0]


def test_readme_layer_groups_example_runs_and_matches_its_output(tmp_path: Path) -> None:
    text = README.read_text()
    found = re.search(
        r"## Layer groups.*?```python\n(.*?)```\n\nPrints:\n\n```\n(.*?)```", text, re.S
    )
    assert found
    script = tmp_path / "groups.py"
    script.write_text(found.group(1))
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == found.group(2)
