"""Lets the root tests import their shared helpers (`server_helpers`) under importlib mode."""

import os
import sys
from pathlib import Path

# As the repository's root conftest, for a run rooted here: no compile cache in the user's
# folder (an env var, so the engine processes the tests spawn see it too).
os.environ.setdefault("PAGEMILL_COMPILE_CACHE", "0")
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

sys.path.insert(0, str(Path(__file__).parent))
