"""A hybrid rank laid out by vLLM's own planner and allocator registers a view per KV cache group.

Qwen3-Next's shape, small: full attention (layer 0) and two recurrent layers (1 and 2), each
layer its own KV cache group, every group backed by the same tensor (vLLM's hybrid allocator: a
block id belongs to one group at a time). The two recurrent layers have the same geometry, so
without groups they would share a view; their pages overlap the attention layer's. The
connector's registration names each view's group, kvroute's validation accepts it, and no view's
layers span two groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines import require_vllm

require_vllm()
torch = pytest.importorskip("torch")

# The conv state channel-major, as kvroute needs (tests/engines/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("channel_major")]
EXTRA = {"url": "http://127.0.0.1:9", "deployment": "hybrid", "instance": "p"}


def layer(index: int) -> str:
    return "model.layers.0.self_attn.attn" if index == 0 else f"model.layers.{index}.mixer"


def _groups() -> list[Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    attention = {"block_size": 16, "num_kv_heads": 4, "head_size": 32, "dtype": torch.float16}
    mamba = MambaSpec(block_size=16, shapes=((80, 3), (4, 16, 16)), dtypes=(torch.float16,) * 2)
    return [
        KVCacheGroupSpec([layer(0)], FullAttentionSpec(**attention)),
        KVCacheGroupSpec([layer(1)], mamba),
        KVCacheGroupSpec([layer(2)], mamba),
    ]


def test_a_view_per_group_and_the_registration_is_accepted(
    tmp_path: Path,
) -> None:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    from kvroute.engines.vllm.worker import rank_cache
    from kvroute.geometry import RankRegistration, check_registration
    from tests.engines import vllm_world as world

    model = world.model_dir(tmp_path, "hybrid", num_key_value_heads=4, num_hidden_layers=3,
                            head_dim=32)  # fmt: skip
    config = world.vllm_config(model, extra=EXTRA)
    kv_cache_config = get_kv_cache_config_from_groups(config, _groups(), 8192 * 12)
    caches = world.allocate(config, kv_cache_config)
    # vLLM's allocator: one tensor backs a layer of each group (the pages alias).
    assert len({t.untyped_storage().data_ptr() for t in caches.values()}) == 1
    cache = rank_cache(config, kv_cache_config, caches)
    document = {**cache.document, "role": "context"}
    reg = RankRegistration.from_json(document, deployment="hybrid", instance="p", rank=0)
    check_registration(reg, [], [])  # no views_overlap: the overlaps lie across groups
    assert {view.kv_group for view in reg.views} == {0, 1, 2}
    for view in reg.views:
        assert view.layer_ids == {view.kv_group}, view.label()  # layer i is group i's only
        assert view.view_id in cache.group_views[view.kv_group]
    assert cache.state_groups == {1, 2}
    starts = {(v.kv_group, v.layers[0].offset) for v in reg.views if not v.is_state}
    states = {(v.kv_group, v.layers[0].offset) for v in reg.views if v.is_state}
    assert starts == {(0, 0)}
    assert {offset for _, offset in states} == {0, 80 * 3 * 2}  # conv at 0, then SSM: both groups


def test_without_group_names_the_same_rank_is_refused(tmp_path: Path) -> None:
    """The rule the groups lift: the same document, its views stripped of ``kv_group``."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    from kvroute.engines.vllm.worker import rank_cache
    from kvroute.geometry import GeometryError, RankRegistration, check_registration
    from tests.engines import vllm_world as world

    model = world.model_dir(tmp_path, "hybrid", num_key_value_heads=4, num_hidden_layers=3,
                            head_dim=32)  # fmt: skip
    config = world.vllm_config(model, extra=EXTRA)
    kv_cache_config = get_kv_cache_config_from_groups(config, _groups(), 8192 * 12)
    cache = rank_cache(config, kv_cache_config, world.allocate(config, kv_cache_config))
    document = {**cache.document, "role": "context"}
    document["views"] = [
        {k: v for k, v in view.items() if k != "kv_group"} for view in document["views"]
    ]
    reg = RankRegistration.from_json(document, deployment="hybrid", instance="p", rank=0)
    with pytest.raises(GeometryError) as refused:
        check_registration(reg, [], [])
    assert refused.value.code == "views_overlap"
