"""`python -m pagemill.server ...` is the `pagemill` command."""

import sys

from .cli import main

sys.exit(main())
