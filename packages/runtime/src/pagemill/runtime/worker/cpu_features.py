"""What the host CPU computes natively, read from the OS without importing torch.

bf16 pays on a CPU only when it has bf16 arithmetic (x86: AVX512-BF16 or AMX; Arm:
FEAT_BF16): oneDNN then runs bf16 GEMMs 2-5x faster than fp32 and halves the bytes every
decode step streams. Without it, bf16 is emulated through fp32 and only loses accuracy.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

# Flags (Linux /proc/cpuinfo "flags" on x86, "Features" on Arm) that mean native bf16.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _cpuinfo_flags(text: str) -> set[str]:
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 arithmetic; False when unsure."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        try:
            return bool(_cpuinfo_flags(cpuinfo.read_text()) & _BF16_FLAGS)
        except OSError:
            return False
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "1"
    return False
