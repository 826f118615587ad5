"""The page's files, read from the package (`static/`): no CDN, nothing fetched at run time.

Its own module so that `pagemill simulate --html` can inline the page without importing
the web framework.
"""

from __future__ import annotations

from importlib import resources


def read_static(name: str) -> str:
    """A file of `static/` as text (the page, its script and style, the vendored uPlot)."""
    return resources.files(__package__).joinpath("static", name).read_text("utf-8")
