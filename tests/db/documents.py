"""Registration documents for store tests, built programmatically in the API.md shape.

One pool per rank holding one K+V target view in HND layout; the knobs are the ones the store tests
need to make ranks compatible or not (TP, heads, head_dim, layers, lease).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvroute.geometry import RankRegistration

BF16_BYTES = 2
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def rank_document(
    *,
    role: str = "context",
    tp_size: int = 1,
    tp_rank: int = 0,
    total_heads: int = 8,
    head_dim: int = 128,
    num_layers: int = 4,
    tokens_per_block: int = 32,
    num_slots: int = 16,
    lease_seconds: int = 30,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    heads = max(1, total_heads // tp_size)
    bytes_per_layer = 2 * heads * tokens_per_block * head_dim * BF16_BYTES
    slot_bytes = num_layers * bytes_per_layer
    pool: dict[str, Any] = {
        "pool_id": 0,
        "slot_bytes": slot_bytes,
        "slot_stride": slot_bytes,
        "num_slots": num_slots,
    }
    if memory is not None:
        pool["memory"] = memory
    return {
        "role": role,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "pp_size": 1,
        "pp_rank": 0,
        "attention_dp": False,
        "dp_size": 1,
        "dp_rank": 0,
        "layers_per_stage": [num_layers],
        "num_draft_layers": 0,
        "tokens_per_block": tokens_per_block,
        "attention": {
            "num_kv_heads": heads,
            "head_dim": head_dim,
            "dtype": "bfloat16",
            "is_mla": False,
        },
        "pools": [pool],
        "views": [
            {
                "view_id": 0,
                "pool_id": 0,
                "kind": "hnd",
                "roles": ["key", "value"],
                "owner": "target",
                "num_kv_heads": heads,
                "total_kv_heads": total_heads,
                "buffers_per_layer": 2,
                "bytes_per_layer": bytes_per_layer,
                "layers": [
                    {"layer": layer, "offset": layer * bytes_per_layer}
                    for layer in range(num_layers)
                ],
            }
        ],
        "lease_seconds": lease_seconds,
    }


def registration(deployment: str, instance: str, rank: int, **document: Any) -> RankRegistration:
    """A parsed registration; ``tp_rank`` defaults to ``rank`` (one PP stage)."""
    document.setdefault("tp_rank", rank)
    return RankRegistration.from_json(
        rank_document(**document), deployment=deployment, instance=instance, rank=rank
    )
