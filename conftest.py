"""Test-wide settings applied before any package module is imported.

Two cores are shared by everything on the CI box: a single intra-op thread keeps small
torch ops from spending their time in thread hand-offs. Triton reads TRITON_INTERPRET when
`@triton.jit` decorates, so the interpreter must be chosen before `pagemill.kernels`
is imported; without a CUDA device the interpreter is the only way to run the kernels.
"""

import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines default to a compiled forward on CPU, which costs tens of seconds per engine; the
# suite builds dozens, so only the tests about compilation (which unset this) pay for it.
os.environ.setdefault("PAGEMILL_ENFORCE_EAGER", "1")
# Packed/dense hand-over points from the fixed table, not timed on a loaded box.
os.environ.setdefault("PAGEMILL_PACKED_LIMITS", "table")
# The compile cache (on by default) would write into the user's cache folder and let one
# run's graphs stand in for the next's; the tests about it turn it on with a tmp folder.
# An env var, not a monkeypatch: it must reach the engine processes the tests spawn.
os.environ.setdefault("PAGEMILL_COMPILE_CACHE", "0")
# A cold start with the cache on compiles before ready (tests that check or time the
# compiled step); the tests about the background compile turn it on.
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")
# The native kernels' builds depend on the machine and the sources alone: the many tests that
# give an engine (or a server) a fresh cache folder share one folder of builds instead of
# compiling every library again in each; the tests about building choose their own.
if not os.environ.get("PAGEMILL_KERNEL_CACHE_DIR"):
    _base = os.environ.get("PAGEMILL_CACHE_DIR")
    _user = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["PAGEMILL_KERNEL_CACHE_DIR"] = (
        os.path.join(_base, "kernels") if _base else os.path.join(_user, "pagemill", "kernels")
    )
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
