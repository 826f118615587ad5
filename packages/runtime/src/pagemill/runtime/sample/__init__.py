"""Choosing tokens: the sampler, its per-step metadata and grammar-constrained decoding."""
