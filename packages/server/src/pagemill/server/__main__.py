"""`python -m pagemill.server ...` is the `pagemill` command."""

import sys

from pagemill.server.cli import main

sys.exit(main())
