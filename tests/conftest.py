"""Lets the root tests import their shared helpers (`server_helpers`) under importlib mode."""

import os
import sys
from pathlib import Path

# As the repository's root conftest, for a run rooted here: no compile cache in the user's
# folder (an env var, so the engine processes the tests spawn see it too).
os.environ.setdefault("PAGEMILL_COMPILE_CACHE", "0")
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")
# Torch's first-call check that no custom op aliases its inputs, on every compiled graph
# (off in a served engine: see `model_runner.OP_ALIASING_CHECK_ENV`).
os.environ.setdefault("PAGEMILL_CHECK_OP_ALIASING", "1")

sys.path.insert(0, str(Path(__file__).parent))
