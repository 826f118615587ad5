"""`pagemill serve --ray` flags: what cannot be honoured is refused in one line, exit 2,
before any model is loaded or Ray is started."""

from __future__ import annotations

import pytest

from pagemill.server.cli import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-replicas", "2"], "--num-replicas and --max-replicas need --ray"),
        (["--ray", "-dp", "2"], "not --data-parallel-size"),
        (["--ray", "--dashboard"], "--dashboard is not served with --ray"),
        (["--ray", "--num-replicas", "0"], "--num-replicas must be >= 1"),
        (["--ray", "--num-replicas", "3", "--max-replicas", "2"], "--max-replicas >="),
        (["--ray", "--tool-call-parser", "hermes"], "--tool-call-parser is not served with"),
        (["--ray", "--allowed-origins", '["*"]', "--max-log-len", "5"], "--allowed-origins, "),
    ],
)
def test_ray_flags_refused(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "no-such-model-folder", *flags]) == 2
    assert message in capsys.readouterr().err
