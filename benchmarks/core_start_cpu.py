"""CPU seconds an engine-core process spends before it names the model file it loads.

Does what a spawned core process does, in this process: import the CLI (the child
re-imports it as `__mp_main__`), torch, the engine core, then `EngineCore.from_config` until
the loader logs "loading <folder> (<file>) ...", where it stops. Prints this process's CPU
seconds (user + system, so the load of a shared machine hardly moves them) at each mark and
which of xgrammar / transformers / tokenizers were imported by then.

    python benchmarks/core_start_cpu.py                       # the default model
    python benchmarks/core_start_cpu.py --model PATH
    # another checkout, same venv (A/B): put its packages first on the path
    PYTHONPATH=$(ls -d /tmp/base/packages/*/src | paste -sd:) python benchmarks/core_start_cpu.py

Needs the model's caches warm (one `pagemill serve` start with the same PAGEMILL_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


class _Stop(Exception):
    pass


def _cpu() -> float:
    t = os.times()
    return round(t.user + t.system, 2)


class _StopAtLoading(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.name.endswith(".loader") and msg.startswith("loading ") and "(" in msg:
            raise _Stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, handlers=[_StopAtLoading()])
    marks: dict[str, float] = {}
    import pagemill.server.cli  # noqa: F401  (what the child imports as __mp_main__)
    from pagemill.runtime.config import DEFAULT_MODEL, EngineConfig

    config = EngineConfig.from_kwargs(model=args.model or DEFAULT_MODEL)
    marks["cli"] = _cpu()
    import torch  # noqa: F401

    marks["torch"] = _cpu()
    from pagemill.runtime.engine.core import EngineCore

    marks["core import"] = _cpu()
    try:
        EngineCore.from_config(config)
    except _Stop:
        pass
    else:
        raise SystemExit("the loader never logged 'loading ... (...)'")
    marks["loading"] = _cpu()
    heavy = sorted(m for m in ("xgrammar", "transformers", "tokenizers") if m in sys.modules)
    print(json.dumps({"cpu_s": marks, "imported": heavy}), flush=True)
    # A core that started grammar workers has threads that die badly at exit: skip it.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
