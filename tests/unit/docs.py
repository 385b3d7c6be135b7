"""Small registration documents for the reference cases (trtllm-native-disagg.md section 4).

Defaults follow the reference: tokens_per_block 16, head_dim 8, bf16, 2 KV heads per rank, TP 2, one
pool, layers [0, 1] with K and V buffers of 256 bytes (512 bytes per layer, 1024-byte slots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvroute.geometry import RankRegistration


def view(
    view_id: int = 0,
    layers: Sequence[int] = (0, 1),
    bytes_per_layer: int = 512,
    *,
    offsets: Sequence[int] | None = None,
    kind: str = "hnd",
    roles: Sequence[str] = ("key", "value"),
    owner: str = "target",
    heads: int | None = None,
    total: int | None = None,
    buffers: int = 2,
    pool: int = 0,
    tokens: int | None = None,
    **members: Any,
) -> dict[str, Any]:
    """A view document; ``members`` adds optional members as given (e.g. ``sliding_window``)."""
    offsets = offsets if offsets is not None else [i * bytes_per_layer for i in range(len(layers))]
    doc: dict[str, Any] = {
        "view_id": view_id,
        "pool_id": pool,
        "kind": kind,
        "roles": list(roles),
        "owner": owner,
        "buffers_per_layer": buffers,
        "bytes_per_layer": bytes_per_layer,
        "layers": [
            {"layer": layer, "offset": off} for layer, off in zip(layers, offsets, strict=True)
        ],
    }
    for key, value in (
        ("num_kv_heads", heads),
        ("total_kv_heads", total),
        ("tokens_per_block", tokens),
    ):
        if value is not None:
            doc[key] = value
    return doc | members


def rank(
    role: str = "context",
    *,
    tp: int = 2,
    tp_rank: int = 0,
    stages: Sequence[int] = (2,),
    pp_rank: int = 0,
    heads: int = 2,
    tpb: int = 16,
    head_dim: int = 8,
    dtype: str = "bfloat16",
    mla: bool = False,
    draft: int = 0,
    dp: int = 1,
    views: Sequence[dict[str, Any]] | None = None,
    slot: int | None = None,
    instance: str | None = None,
    cp: int = 1,
    cp_rank: int = 0,
    cp_layout: str = "interleaved",
    interleave: int = 1,
) -> RankRegistration:
    views = list(views) if views is not None else [view()]
    end = max((s["offset"] + v["bytes_per_layer"] for v in views for s in v["layers"]), default=1)
    pools = sorted({v["pool_id"] for v in views} or {0})
    doc = {
        "role": role,
        "tp_size": tp,
        "tp_rank": tp_rank,
        "pp_size": len(stages),
        "pp_rank": pp_rank,
        "attention_dp": dp > 1,
        "dp_size": dp,
        "dp_rank": tp_rank // (tp // dp) if dp > 1 else 0,
        "cp_size": cp,
        "cp_rank": cp_rank,
        "cp_layout": cp_layout,
        "cp_interleave": interleave,
        "layers_per_stage": list(stages),
        "num_draft_layers": draft,
        "tokens_per_block": tpb,
        "attention": {"num_kv_heads": heads, "head_dim": head_dim, "dtype": dtype, "is_mla": mla},
        "pools": [{"pool_id": p, "slot_bytes": slot or end, "num_slots": 8} for p in pools],
        "views": views,
    }
    name = instance or ("ctx" if role == "context" else "gen")
    return RankRegistration.from_json(
        doc, deployment="d", instance=name, rank=(pp_rank * tp + tp_rank) * cp + cp_rank
    )


def instance(
    role: str,
    *,
    tp: int,
    stages: Sequence[int] = (2,),
    views: Callable[[int, int], Sequence[dict[str, Any]]] | None = None,
    **kwargs: Any,
) -> list[RankRegistration]:
    """All ranks of an instance; ``views(tp_rank, pp_rank)`` gives each rank's views."""
    return [
        rank(
            role,
            tp=tp,
            tp_rank=t,
            stages=stages,
            pp_rank=p,
            views=views(t, p) if views else None,
            **kwargs,
        )
        for p in range(len(stages))
        for t in range(tp)
    ]


def stage_layers(stages: Sequence[int], pp_rank: int) -> list[int]:
    start = sum(stages[:pp_rank])
    return list(range(start, start + stages[pp_rank]))


def peers(plan_json: dict[str, Any]) -> list[int]:
    return [p["rank"] for p in plan_json["peers"]]


def senders(plan_json: dict[str, Any]) -> list[int]:
    return [p["rank"] for p in plan_json["peers"] if p["sends"]]


def fragments(plan_json: dict[str, Any], rank: int, dst_view: int = 0) -> list[list[int]]:
    peer = next(p for p in plan_json["peers"] if p["rank"] == rank)
    return next(v["fragments"] for v in peer["views"] if v["dst_view"] == dst_view)
