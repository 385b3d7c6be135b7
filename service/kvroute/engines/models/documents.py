"""Every rank's registration document for a model config and a parallel layout.

A rank registers one pool whose slot holds, back to back (256-byte aligned, as
``client.pools.SharedKvPool.carve`` lays them out): the target's attention KV (HND, one region per
window class), MLA latent rows, indexer keys, then the draft's (Eagle or MTP) layers on the last PP
stage. Recurrent state (Mamba, or linear attention: Gated DeltaNet, Kimi Delta Attention, MiniMax
lightning) shares the slots from byte 0, as ``client.hybrid.HybridPool`` lays it out (a slot is a KV
block or one request's state). Heads are split over the attention-DP group's TP by rule 1;
a TP the heads do not divide still gets its document, so registration gives its real verdict
(``tp_heads_not_divisible``). What an engine could not run at all (Mamba heads that do not split
over TP, MTP layers the config does not have) is refused here instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvroute.client.pools import DEFAULT_ALIGNMENT, KvLayout, PoolDescription, align
from kvroute.engines.models.config import ModelSpec
from kvroute.engines.models.errors import UnsupportedConfig
from kvroute.engines.models.layout import Layout, LayoutError, kv_dtype
from kvroute.geometry import DTYPE_BITS, Kind, Owner
from kvroute.geometry.leaves.heads import per_rank_heads
from kvroute.geometry.registration.builder import LayerSpec, build_views
from kvroute.geometry.registration.rendering import render_view

LATENT_ROLES = frozenset({"latent"})
INDEX_ROLES = frozenset({"index_key"})


@dataclass(frozen=True, slots=True)
class ReplicatedRegion:
    """Layers whose one buffer per token row is the same on every TP rank (MLA latent, indexer)."""

    layer_ids: tuple[int, ...]
    bytes_per_layer: int
    roles: frozenset[str]
    owner: Owner = Owner.TARGET

    @property
    def block_bytes(self) -> int:
        return len(self.layer_ids) * self.bytes_per_layer

    def layer_specs(self, pool_id: int, offset: int) -> list[LayerSpec]:
        return [
            LayerSpec(
                layer,
                pool_id,
                offset + index * self.bytes_per_layer,
                self.bytes_per_layer,
                Kind.REPLICATED,
                self.owner,
                self.roles,
                buffers_per_layer=1,
            )
            for index, layer in enumerate(self.layer_ids)
        ]


Region = KvLayout | ReplicatedRegion


@dataclass(frozen=True, slots=True)
class Draft:
    """The draft a layout carries: an Eagle model's spec, or the target's own MTP layers."""

    spec: ModelSpec
    num_layers: int

    @classmethod
    def of(cls, model: ModelSpec, layout: Layout, eagle: ModelSpec | None) -> Draft | None:
        if eagle is not None and layout.mtp:
            raise LayoutError("give a draft model or mtp layers, not both")
        if eagle is not None:
            if eagle.mamba is not None:
                raise UnsupportedConfig("hybrid_override_pattern", "a recurrent draft model")
            return cls(eagle, eagle.num_layers)
        if not layout.mtp:
            return None
        if layout.mtp > model.mtp_layers:
            raise UnsupportedConfig(
                "num_nextn_predict_layers",
                f"the config declares {model.mtp_layers} MTP layers; the layout asks for {layout.mtp}",
            )
        return cls(model, layout.mtp)


def rank_documents(
    model: ModelSpec, layout: Layout, *, draft_model: ModelSpec | None = None
) -> list[dict[str, Any]]:
    """The documents of every rank of an instance, in rank order (rank = pp_rank * tp + tp_rank)."""
    stages = layout.stages(model.num_layers)
    draft = Draft.of(model, layout, draft_model)
    return [
        rank_document(model, layout, stages, draft, pp_rank, tp_rank)
        for pp_rank in range(layout.pp)
        for tp_rank in range(layout.tp)
    ]


def rank_document(
    model: ModelSpec,
    layout: Layout,
    stages: tuple[int, ...],
    draft: Draft | None,
    pp_rank: int,
    tp_rank: int,
) -> dict[str, Any]:
    start = sum(stages[:pp_rank])
    held = range(start, start + stages[pp_rank])
    dtype = kv_dtype(layout.dtype, model.dtype)
    group_tp = layout.tp // layout.dp
    regions = _target_regions(model, layout, held, dtype, group_tp)
    if draft is not None and pp_rank == layout.pp - 1:
        ids = tuple(range(draft.num_layers))
        regions += _attention_regions(draft.spec, layout, ids, dtype, group_tp, Owner.DRAFT)
    pool = _pool(model, layout, held, regions, group_tp)
    views = build_views(pool.specs)
    return {
        "role": layout.role,
        "tp_size": layout.tp,
        "tp_rank": tp_rank,
        "pp_size": layout.pp,
        "pp_rank": pp_rank,
        "attention_dp": layout.attention_dp,
        "dp_size": layout.dp,
        "dp_rank": tp_rank // group_tp if layout.attention_dp else 0,
        "layers_per_stage": list(stages),
        "num_draft_layers": draft.num_layers if draft else 0,
        "tokens_per_block": layout.tpb,
        "attention": {
            "num_kv_heads": per_rank_heads(model.num_kv_heads, group_tp) if not model.mla else 1,
            "head_dim": model.head_dim,
            "dtype": dtype,
            "is_mla": model.mla is not None,
        },
        "pools": [pool.to_json()],
        "views": [render_view(view) for view in views],
    }


def _target_regions(
    model: ModelSpec, layout: Layout, held: range, dtype: str, group_tp: int
) -> list[Region]:
    ids = tuple(layer for layer in model.attention_layers if layer in held)
    return _attention_regions(model, layout, ids, dtype, group_tp, Owner.TARGET)


def _attention_regions(
    model: ModelSpec,
    layout: Layout,
    ids: tuple[int, ...],
    dtype: str,
    group_tp: int,
    owner: Owner,
) -> list[Region]:
    """The KV regions of attention layers ``ids`` (draft layers take the model's first group)."""
    if not ids:
        return []
    element = DTYPE_BITS[dtype] // 8
    if model.mla is not None:
        regions: list[Region] = [
            ReplicatedRegion(ids, layout.tpb * model.mla.row * element, LATENT_ROLES, owner)
        ]
        if model.index_head_dim is not None:
            row = layout.tpb * model.index_row_bytes
            regions.append(ReplicatedRegion(ids, row, INDEX_ROLES, owner))
        return regions
    groups = (
        [(ids, None)]
        if owner is Owner.DRAFT
        else [(tuple(i for i in g.layer_ids if i in ids), g.sliding_window) for g in model.groups]
    )
    heads = per_rank_heads(model.num_kv_heads, group_tp)
    return [
        KvLayout(
            Kind.HND,
            len(layer_ids),
            heads,
            layout.tpb,
            model.head_dim,
            dtype,
            owner,
            total_kv_heads=model.num_kv_heads,
            layer_ids=layer_ids,
            sliding_window=window,
        )
        for layer_ids, window in groups
        if layer_ids
    ]


def _pool(
    model: ModelSpec, layout: Layout, held: range, regions: list[Region], group_tp: int
) -> PoolDescription:
    specs: list[LayerSpec] = []
    end = 0
    for region in regions:
        offset = align(end, DEFAULT_ALIGNMENT)
        specs += region.layer_specs(0, offset)
        end = offset + region.block_bytes
    if model.mamba is not None:
        ids = tuple(layer for layer in model.mamba.layer_ids if layer in held)
        if ids:
            state_dtype = kv_dtype(layout.state_dtype, model.dtype)
            state = model.mamba.layout(ids, group_tp, state_dtype)
            specs += state.layer_specs(0, 0)
            end = max(end, state.slot_bytes)
    if end == 0:
        raise LayoutError(
            f"PP stage [{held.start}, {held.stop}) holds no cached layer; choose another split"
        )
    return PoolDescription(0, end, align(end, DEFAULT_ALIGNMENT), layout.blocks, tuple(specs))
