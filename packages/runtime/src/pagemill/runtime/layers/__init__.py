"""Layers whose weights may come in more than one format (dense, quantized)."""

from .linear import Linear

__all__ = ["Linear"]
