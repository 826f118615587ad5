"""`python -m pagemill.server.sim plan|simulate ...` — the subcommands without the server CLI."""

import sys

from pagemill.server.sim.cli import main

sys.exit(main())
