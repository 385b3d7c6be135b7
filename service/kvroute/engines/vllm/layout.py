"""A vLLM rank's KV cache as a kvroute registration, read off what vLLM hands the connector.

vLLM describes its cache in a ``KVCacheConfig`` (groups of layers sharing a spec, and tensors
placing layers in one backing allocation at ``offset + l * layer_stride + b * block_stride``) and
gives the connector one strided view per layer. Nothing here assumes a layout: each layer's block
stride, head/token order and K/V placement are read from its tensor's strides (vLLM 0.34 packs K
and V in the last dimension of ``[blocks, heads, tokens, head_size + head_size_v]``; older
versions put K/V in a leading dimension of size 2). Layers whose pages share a block stride and
fall inside one block of the same region become one kvroute pool (a block-outermost layout gives
one pool per rank, a layer-outermost layout one pool per layer); the views are then built by
``kvroute.geometry.registration.builder`` from per-layer specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.client.nixl_descs import PoolAddress
from kvroute.client.nixl_transport import nixl_memory
from kvroute.client.pools import Parallel, PoolDescription
from kvroute.engines.vllm.probe import Layout
from kvroute.engines.vllm.states import dtype_name, state_specs
from kvroute.geometry import Kind, Owner
from kvroute.geometry.registration.builder import LayerSpec, build_views
from kvroute.geometry.registration.rendering import render_view

if TYPE_CHECKING:
    import torch

KV_ROLES = frozenset({"key", "value"})
MLA_ROLES = frozenset({"latent"})


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer as vLLM hands it over: its name, spec, owner, id and tensor."""

    name: str
    layer_id: int  # global id in the owner's namespace
    owner: Owner
    spec: Any  # a vLLM KVCacheSpec
    tensor: torch.Tensor
    group: int  # KV cache group index


@dataclass
class RankCache:
    """What the connector registers and what its NIXL agent needs."""

    document: dict[str, Any]
    addresses: dict[int, PoolAddress]
    mem_type: str = "DRAM"  # NIXL's memory type of this rank's pools (VRAM on a GPU)
    group_views: dict[int, set[int]] = field(default_factory=dict)  # group -> view ids
    state_groups: set[int] = field(default_factory=set)  # groups holding recurrent state


@dataclass
class _Pool:
    base: int
    stride: int
    slots: int
    device: int
    specs: list[tuple[LayerSpec, int, int]] = field(default_factory=list)  # spec, address, group
    end: int = 0  # bytes used in a slot


def describe(
    layers: list[Layer],
    *,
    layouts: Mapping[str, Layout],
    place: Parallel,
    total_kv_heads: Mapping[Owner, int | None],
    conv_dim_first: bool,
    num_draft_layers: int = 0,
    lease_seconds: int = 30,
) -> RankCache:
    """The registration document of one rank (NIXL metadata is added by the caller)."""
    pools: list[_Pool] = []
    for layer in sorted(layers, key=lambda layer: layer.tensor.data_ptr()):
        for offset_in_page, spec in _layer_specs(layer, layouts, total_kv_heads, conv_dim_first):
            address = layer.tensor.data_ptr() + offset_in_page
            _place_spec(pools, layer, spec, address)
    # With several KV cache groups (vLLM's hybrid allocator) each layer's spec names its group:
    # views are then split so that none spans two groups, and pages of different groups may
    # share bytes (a block id belongs to one group at a time). One group keeps the old document.
    named = len({layer.group for layer in layers}) > 1
    descriptions, addresses = [], {}
    for pool_id, pool in enumerate(pools):
        specs = [
            _with_pool(spec, pool_id, address - pool.base, group if named else None)
            for spec, address, group in pool.specs
        ]
        descriptions.append(
            PoolDescription(
                pool_id,
                pool.end,
                pool.stride,
                pool.slots,
                tuple(specs),
                {
                    "backend": "local",
                    "nixl": nixl_memory(pool.base, device=pool.device, mem_type=_mem_type(layers)),
                },
            )
        )
        addresses[pool_id] = PoolAddress(pool.base, pool.stride, pool.slots, pool.device)
    views = build_views(spec for pool in descriptions for spec in pool.specs)
    cache = RankCache(
        _document(place, layers, descriptions, views, num_draft_layers, lease_seconds),
        addresses,
        _mem_type(layers),
    )
    only_group = min((layer.group for layer in layers), default=0)
    for view in views:
        group = only_group if view.kv_group is None else view.kv_group
        cache.group_views.setdefault(group, set()).add(view.view_id)
        if view.kind.recurrent:
            cache.state_groups.add(group)
    return cache


def _mem_type(layers: list[Layer]) -> str:
    return "VRAM" if layers and layers[0].tensor.device.type == "cuda" else "DRAM"


def _with_pool(spec: LayerSpec, pool_id: int, offset: int, group: int | None) -> LayerSpec:
    from dataclasses import replace

    return replace(spec, pool_id=pool_id, offset=offset, kv_group=group)


def _place_spec(pools: list[_Pool], layer: Layer, spec: LayerSpec, address: int) -> None:
    """Puts a region in the pool whose first block it falls in, or opens a pool at it."""
    stride = layer.tensor.stride(0) * layer.tensor.element_size()
    for pool in pools:
        if pool.stride == stride and pool.base <= address < pool.base + stride:
            if address - pool.base + spec.bytes_per_layer > stride:
                raise ValueError(f"layer {layer.name}'s page crosses its block stride")
            break
    else:
        device = layer.tensor.device.index if layer.tensor.device.type == "cuda" else 0
        pool = _Pool(address, stride, layer.tensor.shape[0], device or 0)
        pools.append(pool)
    pool.specs.append((spec, address, layer.group))
    pool.end = max(pool.end, address - pool.base + spec.bytes_per_layer)


def _layer_specs(
    layer: Layer,
    layouts: Mapping[str, Layout],
    totals: Mapping[Owner, int | None],
    conv_dim_first: bool,
) -> list[tuple[int, LayerSpec]]:
    """(offset inside the layer's page, spec) of each region the layer's page holds."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec, tensor = layer.spec, layer.tensor
    if isinstance(spec, MambaSpec):
        return state_specs(layer, conv_dim_first)
    if isinstance(spec, MLAAttentionSpec):
        if layer.name not in layouts:
            raise ValueError(
                f"layer {layer.name}: its latent layout was not probed; nothing is guessed"
            )
        return [(0, _mla_spec(layer))]
    if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec) or type(spec) not in (
        FullAttentionSpec,
        SlidingWindowSpec,
    ):
        kind = type(spec).__name__
        raise ValueError(f"layer {layer.name}: KV cache spec {kind} is not supported by kvroute")
    assert isinstance(spec, AttentionSpec)
    if spec.num_head_slots is not None or spec.state_content_bytes is not None:
        raise ValueError(f"layer {layer.name}: packed head slots are not supported by kvroute")
    attention_layout(tensor, layer.name)  # one contiguous page per block, or refused
    layout = layouts.get(layer.name)
    if layout is None:
        raise ValueError(f"layer {layer.name}: its layout was not probed; nothing is guessed")
    common: dict[str, Any] = {
        "layer": layer.layer_id,
        "pool_id": 0,
        "offset": 0,
        "owner": layer.owner,
        "roles": KV_ROLES,
        "num_kv_heads": spec.num_kv_heads,
        "total_kv_heads": totals.get(layer.owner),
        "kind": layout.kind,
        "buffers_per_layer": layout.buffers,
        "interior": layout.interior,
        # Only a SlidingWindowSpec group holds just the window's blocks. A FullAttentionSpec
        # group (hybrid allocator off) keeps every token, and its merged spec names the window of
        # some of its layers only: moving all tokens is right for each of them.
        "sliding_window": spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
    }
    page = spec.num_kv_heads * spec.block_size * (spec.head_size + spec.head_size_v)
    return [(0, LayerSpec(bytes_per_layer=page * tensor.element_size(), **common))]


def attention_layout(tensor: torch.Tensor, name: str) -> tuple[Kind, int]:
    """(kind, K/V buffers per layer region) read off a layer's tensor strides.

    ``[B, H, N, C]`` with K and V packed in C is one buffer, head-major (``hnd``) or token-major
    (``nhd``) by which of H and N has the larger stride; ``[B, 2, H|N, N|H, D]`` holds K then V
    in each block (two buffers). Anything else (a block whose page is not one contiguous run) is
    refused: kvroute addresses a layer's page as ``[buffers][rows]`` inside a slot.
    """
    shape, strides = tuple(tensor.shape), tensor.stride()
    if tensor.dim() == 5 and shape[1] == 2:
        buffer = shape[2] * shape[3] * shape[4]
        kind, _ = _row_order(shape[2:], strides[2:], name)
        if strides[1] == buffer:
            return kind, 2
    elif tensor.dim() == 4:
        return _row_order(shape[1:], strides[1:], name)
    raise ValueError(
        f"layer {name}: KV tensor of shape {shape} and strides {strides} is neither "
        "[blocks, heads, tokens, K|V] nor [blocks, 2, ...] with a contiguous page per block"
    )


def _row_order(shape: tuple[int, ...], strides: tuple[int, ...], name: str) -> tuple[Kind, int]:
    heads, tokens, row = shape
    if strides[2] != 1:
        raise ValueError(f"layer {name}: the last KV dimension is not contiguous ({strides})")
    if strides[1] == row and strides[0] == tokens * row:
        return Kind.HND, 1
    if strides[0] == row and strides[1] == heads * row:
        return Kind.NHD, 1
    raise ValueError(f"layer {name}: heads and tokens are not one contiguous page ({strides})")


def _mla_spec(layer: Layer) -> LayerSpec:
    spec, tensor = layer.spec, layer.tensor
    if tensor.dim() != 4 or tensor.shape[1] != 1:
        raise ValueError(f"layer {layer.name}: MLA cache of shape {tuple(tensor.shape)}")
    _row_order(tuple(tensor.shape[1:]), tensor.stride()[1:], layer.name)
    page = spec.block_size * spec.head_size * tensor.element_size()
    return LayerSpec(
        layer.layer_id,
        0,
        0,
        page,
        kind=Kind.REPLICATED,
        owner=layer.owner,
        roles=MLA_ROLES,
        buffers_per_layer=1,
    )


def _document(
    place: Parallel,
    layers: list[Layer],
    pools: list[PoolDescription],
    views: Any,
    num_draft_layers: int,
    lease_seconds: int,
) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    attention = [
        layer
        for layer in layers
        if layer.owner is Owner.TARGET and isinstance(layer.spec, AttentionSpec)
    ]
    if not attention:
        raise ValueError("the model has no target attention layer: nothing kvroute can describe")
    first = attention[0].spec
    is_mla = isinstance(first, MLAAttentionSpec)
    return {
        "role": "context",  # the connector sets its own role
        **place.members(),
        "num_draft_layers": num_draft_layers,
        "tokens_per_block": first.block_size,
        "attention": {
            "num_kv_heads": 1 if is_mla else first.num_kv_heads,
            "head_dim": first.head_size,
            "dtype": dtype_name(first.dtype),
            "is_mla": is_mla,
        },
        "pools": [pool.to_json() for pool in pools],
        "views": [render_view(view) for view in views],
        "lease_seconds": lease_seconds,
    }
