"""A client-like load: wakes every PERIOD microseconds, burns BUSY microseconds of CPU.

python noise.py 1200 100    # ~8 % of one core, in short bursts
"""

from __future__ import annotations

import sys
import time

period = float(sys.argv[1]) * 1e-6 if len(sys.argv) > 1 else 1.2e-3
busy = float(sys.argv[2]) * 1e-6 if len(sys.argv) > 2 else 1e-4
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(period)
