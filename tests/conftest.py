"""Lets the root tests import their shared helpers (`server_helpers`) under importlib mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
