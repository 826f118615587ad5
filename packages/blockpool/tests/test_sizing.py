"""Sizing arithmetic: bytes per token and blocks per budget."""

from __future__ import annotations

import pytest

from pagemill.blockpool import DTYPE_BYTES, kv_bytes_per_token, num_blocks_for_budget


def test_llama_3_1_8b_bf16_is_128_kib_per_token() -> None:
    # 2 (K and V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes
    assert kv_bytes_per_token(32, 8, 128, "bfloat16") == 131072


def test_dtype_spellings_and_element_sizes() -> None:
    assert kv_bytes_per_token(30, 3, 64, "float16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(30, 3, 64, "torch.float32") == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(30, 3, 64, "bf16") == kv_bytes_per_token(30, 3, 64, 2)
    assert kv_bytes_per_token(1, 1, 1, "fp8") == 2
    assert DTYPE_BYTES["bfloat16"] == 2 and DTYPE_BYTES["float32"] == 4


def test_blocks_for_budget_floors_to_whole_blocks() -> None:
    per_token = kv_bytes_per_token(32, 8, 128, "bfloat16")
    assert num_blocks_for_budget(1 << 30, 16, per_token) == 512  # 1 GiB / 2 MiB per block
    assert num_blocks_for_budget((1 << 30) - 1, 16, per_token) == 511
    assert num_blocks_for_budget(0, 16, per_token) == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 8, 128, "float16"), "num_layers"),
        ((32, -1, 128, "float16"), "num_kv_heads"),
        ((32, 8, 0, "float16"), "head_dim"),
        ((32, 8, 128, "float64"), "unsupported KV dtype"),
        ((32, 8, 128, 0), "element size"),
    ],
)
def test_bytes_per_token_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_bytes_per_token(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 16, 10), "budget_bytes"),
        ((100, 0, 10), "block_size"),
        ((100, 16, 0), "bytes_per_token"),
    ],
)
def test_blocks_for_budget_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        num_blocks_for_budget(*args)
