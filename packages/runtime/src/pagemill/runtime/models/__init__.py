"""Model implementations on pagemill kernels (one module per architecture family)."""

from .llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
