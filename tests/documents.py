"""A factory of registration documents (docs/geometry.md) for store, API and client tests.

Byte sizes are laid out from first principles (HND, K and V buffers, bfloat16 by default),
so a document is self-consistent unless a test changes one field on purpose.
"""

from __future__ import annotations

from typing import Any

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def heads_per_rank(total: int, tp_size: int) -> int:
    return total // tp_size if tp_size <= total else 1


def rank_document(
    *,
    role: str = "context",
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    num_layers: int = 4,
    total_kv_heads: int = 8,
    head_dim: int = 16,
    tokens_per_block: int = 4,
    dtype: str = "bfloat16",
    num_draft_layers: int = 0,
    draft_kv_heads: int = 1,
    lease_seconds: int = 30,
    num_slots: int = 64,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rank's document; target views per PP stage, draft layers on the last stage."""
    element = ELEMENT_BYTES[dtype]
    per_stage = num_layers // pp_size
    first = pp_rank * per_stage
    heads = heads_per_rank(total_kv_heads, tp_size)
    target_bytes = 2 * heads * tokens_per_block * head_dim * element
    views = [
        {
            "view_id": 0,
            "pool_id": 0,
            "kind": "hnd",
            "roles": ["key", "value"],
            "owner": "target",
            "num_kv_heads": heads,
            "total_kv_heads": total_kv_heads,
            "buffers_per_layer": 2,
            "bytes_per_layer": target_bytes,
            "layers": [
                {"layer": first + index, "offset": index * target_bytes}
                for index in range(per_stage)
            ],
        }
    ]
    slot_bytes = per_stage * target_bytes
    if num_draft_layers and pp_rank == pp_size - 1:
        draft_heads = heads_per_rank(draft_kv_heads, tp_size)
        draft_bytes = 2 * draft_heads * tokens_per_block * head_dim * element
        views.append(
            {
                "view_id": 1,
                "pool_id": 0,
                "kind": "hnd",
                "roles": ["key", "value"],
                "owner": "draft",
                "num_kv_heads": draft_heads,
                "total_kv_heads": draft_kv_heads,
                "buffers_per_layer": 2,
                "bytes_per_layer": draft_bytes,
                "layers": [
                    {"layer": index, "offset": slot_bytes + index * draft_bytes}
                    for index in range(num_draft_layers)
                ],
            }
        )
        slot_bytes += num_draft_layers * draft_bytes
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
        "pp_size": pp_size,
        "pp_rank": pp_rank,
        "attention_dp": False,
        "dp_size": 1,
        "dp_rank": 0,
        "layers_per_stage": [per_stage] * pp_size,
        "num_draft_layers": num_draft_layers,
        "tokens_per_block": tokens_per_block,
        "attention": {
            "num_kv_heads": heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "is_mla": False,
        },
        "pools": [pool],
        "views": views,
        "lease_seconds": lease_seconds,
    }
