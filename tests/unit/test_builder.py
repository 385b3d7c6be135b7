"""The worker view builder partitions layers into homogeneous views."""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, Kind, Owner
from kvroute.geometry.registration.builder import LayerSpec, build_views


def _spec(layer: int, offset: int, **kwargs) -> LayerSpec:
    return LayerSpec(
        layer=layer,
        pool_id=kwargs.pop("pool_id", 0),
        offset=offset,
        bytes_per_layer=kwargs.pop("size", 512),
        **kwargs,
    )


def test_target_and_draft_layers_in_one_pool_become_separate_views() -> None:
    specs = [_spec(i, i * 512, num_kv_heads=2) for i in range(3)]
    specs.append(_spec(0, 3 * 512, size=256, owner=Owner.DRAFT, num_kv_heads=1))
    target, draft = build_views(specs)
    assert (target.owner, target.num_kv_heads, sorted(target.layer_ids)) == (
        Owner.TARGET,
        2,
        [0, 1, 2],
    )
    assert (draft.owner, draft.num_kv_heads, draft.offsets) == (Owner.DRAFT, 1, {0: 1536})


def test_mixed_head_counts_never_share_a_view() -> None:
    specs = [
        _spec(0, 0, num_kv_heads=2),
        _spec(1, 512, num_kv_heads=4, size=1024),
        _spec(2, 1536, num_kv_heads=2),
    ]
    views = build_views(specs)
    assert [(v.num_kv_heads, sorted(v.layer_ids)) for v in views] == [(2, [0, 2]), (4, [1])]


def test_replicated_views_record_no_head_count() -> None:
    (index,) = build_views(
        [
            _spec(
                0,
                0,
                kind=Kind.REPLICATED,
                roles=frozenset({"index_key"}),
                num_kv_heads=8,
                buffers_per_layer=1,
            )
        ]
    )
    assert index.num_kv_heads is None
    assert index.total_kv_heads is None


def test_views_are_ordered_by_pool_then_offset_and_layers_by_offset() -> None:
    specs = [
        _spec(1, 0, pool_id=1),
        _spec(0, 512, pool_id=1),
        _spec(5, 4096, pool_id=0, roles=frozenset({"key"}), buffers_per_layer=1),
    ]
    views = build_views(specs, first_view_id=10)
    assert [(v.view_id, v.pool_id) for v in views] == [(10, 0), (11, 1)]
    assert [slot.layer for slot in views[1].layers] == [1, 0]


def test_a_layer_described_twice_is_refused() -> None:
    with pytest.raises(GeometryError) as refused:
        build_views([_spec(0, 0), _spec(0, 512)])
    assert refused.value.code == "duplicate_layer"


def test_layers_described_by_k_and_v_buffers() -> None:
    spec = LayerSpec.from_buffers(3, 0, [(1536, 256), (1280, 256)], num_kv_heads=2)
    assert (spec.offset, spec.bytes_per_layer, spec.buffers_per_layer) == (1280, 512, 2)


@pytest.mark.parametrize(
    ("buffers", "code"),
    [
        ([(0, 256), (512, 256)], "buffers_not_contiguous"),
        ([(0, 256), (256, 128)], "buffers_not_uniform"),
        ([], "buffers_not_uniform"),
    ],
)
def test_buffers_must_be_equal_and_back_to_back(buffers, code) -> None:
    with pytest.raises(GeometryError) as refused:
        LayerSpec.from_buffers(0, 0, buffers)
    assert refused.value.code == code
