"""Layers whose weights may come in more than one format (dense, quantized)."""

from pagemill.runtime.model_executor.layers.linear import Linear, packed_row_limits

__all__ = ["Linear", "packed_row_limits"]
