"""Speculative decoding: proposers guess a few tokens, the target model verifies them all in
one step (`sample/rejection_sampler.py`), and the output stays exactly what decoding one
token at a time would give (greedy) or follows the same distribution (sampling).

Torch-free at import time: the config is read by the CLI.
"""

from pagemill.runtime.spec_decode.config import SPEC_METHODS, SpeculativeConfig

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]
