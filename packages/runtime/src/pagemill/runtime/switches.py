"""On/off switches read from the environment (`PAGEMILL_...=0|1`).

An env var reaches spawned engine processes too, which is why experiments and test suites
set these rather than a config field. A misspelt value must not silently leave a switch
where it was, so anything but 0, 1 or blank is refused with the variable's name.
"""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """`name` as 0 (off) or 1 (on); unset or blank: `default`; any other value raises
    ValueError naming the variable."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
