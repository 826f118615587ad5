"""Layer grouping (vLLM's uniform-page rule) and the hybrid manager's capacity answers,
checked against their definitions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemill.blockpool import HybridKVCacheManager, KVCacheGroupSpec, group_layers_by_window
from pagemill.blockpool.kv_cache_groups import group_size, layer_group, layer_tensor_index


def test_one_attention_type_is_one_group() -> None:
    assert group_layers_by_window([0, 0, 0]) == [KVCacheGroupSpec((0, 1, 2))]
    assert group_layers_by_window([8, 8]) == [KVCacheGroupSpec((0, 1), 8)]


def test_gemma2_alternating_layers_form_two_equal_groups() -> None:
    groups = group_layers_by_window([4096 if i % 2 == 0 else 0 for i in range(26)])
    assert [(len(g.layer_ids), g.sliding_window) for g in groups] == [(13, None), (13, 4096)]
    assert groups[0].layer_ids == tuple(range(1, 26, 2))


def test_gemma3_five_windowed_layers_per_full_one() -> None:
    """26 layers, full every sixth: groups of the 4 full layers' size; the windowed
    layers make 6 groups, the last of 2 (its blocks leave 2 of the 4 tensors unused)."""
    windows = [0 if i % 6 == 5 else 512 for i in range(26)]
    groups = group_layers_by_window(windows)
    assert groups[0] == KVCacheGroupSpec((5, 11, 17, 23))
    assert [len(g.layer_ids) for g in groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert group_size(groups) == 4
    tensor = layer_tensor_index(groups, 26)
    group = layer_group(groups, 26)
    # Within a group every layer has its own tensor; across groups tensors are shared.
    for g in range(len(groups)):
        mine = [tensor[i] for i in range(26) if group[i] == g]
        assert sorted(mine) == list(range(len(mine)))


def test_close_counts_use_the_larger_group() -> None:
    """4 windowed and 3 full layers: two groups of up to 4, not four groups of up to 3;
    3 windowed and 2 full: 3 is not under 1.5x 2, so groups of 2."""
    groups = group_layers_by_window([8, 0, 8, 0, 8, 0, 8])
    assert [g.layer_ids for g in groups] == [(1, 3, 5), (0, 2, 4, 6)]
    groups = group_layers_by_window([8, 0, 8, 0, 8])
    assert [g.layer_ids for g in groups] == [(1, 3), (0, 2), (4,)]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError):
        group_layers_by_window([])
    with pytest.raises(ValueError):
        KVCacheGroupSpec(())
    with pytest.raises(ValueError):
        layer_tensor_index([KVCacheGroupSpec((0,)), KVCacheGroupSpec((0,), 4)], 1)
    with pytest.raises(ValueError, match="cannot hold one token"):
        HybridKVCacheManager(2, 4, [KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), 4)])


def needed(m: HybridKVCacheManager, c: int, total: int) -> int:
    """Blocks held after a step from c to `total` tokens, by the definition."""
    bs = m.block_size
    n = -(-total // bs)
    held = 0
    for w in m.windows:
        skip = 0 if w is None else max(0, (c - w + 1) // bs)
        held += n - min(skip, n)
    return held


@settings(max_examples=200, deadline=None)
@given(
    windows=st.lists(st.sampled_from([None, 1, 5, 8, 30]), min_size=1, max_size=4),
    num_blocks=st.integers(12, 80),
    c=st.integers(0, 400),
)
def test_max_num_tokens_is_the_most_that_fits(
    windows: list[int | None], num_blocks: int, c: int
) -> None:
    groups = [KVCacheGroupSpec((i,), w) for i, w in enumerate(windows)]
    try:
        m = HybridKVCacheManager(num_blocks, 4, groups)
    except ValueError:
        return  # too small for one token in every group
    t = m.max_num_tokens(c)
    assert t % 4 == 0
    if t > 0:
        assert needed(m, c, t) <= m.num_usable_blocks
    assert needed(m, c, t + 4) > m.num_usable_blocks
    cap = m.request_capacity_tokens(chunked_prefill=True)
    if cap is not None and c < cap:
        # A request below its capacity can always take one more token.
        assert t > c
