"""Layers whose weights may come in more than one format (dense, quantized)."""

from .linear import Linear, packed_row_limits

__all__ = ["Linear", "packed_row_limits"]
