"""The package version, from the installed metadata (one source of truth: pyproject.toml)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagemill-server")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
