"""A registration rendered back to its document: the JSON ``document`` reads, member for member.

Optional members are written only when set, so a rank that never declared one renders (and
digests) as it did before the member existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.geometry.leaves.parts import Pool, View
from kvroute.geometry.registration.domains import render_topology
from kvroute.geometry.registration.identity import render_identity

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


def render_view(view: View) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "view_id": view.view_id,
        "pool_id": view.pool_id,
        "kind": view.kind.value,
        "roles": sorted(view.roles),
        "owner": view.owner.value,
        "buffers_per_layer": view.buffers_per_layer,
        "bytes_per_layer": view.bytes_per_layer,
        # A slot per layer: unpacked rather than read by name (a registration renders twice).
        "layers": [{"layer": layer, "offset": offset} for layer, offset in view.layers],
    }
    for key in (
        "num_kv_heads",
        "total_kv_heads",
        "tokens_per_block",
        "dtype",
        "ssm_bytes_per_head",
        "sliding_window",
        "kv_group",
    ):
        if getattr(view, key) is not None:
            doc[key] = getattr(view, key)
    if view.conv_sections is not None:
        doc["conv_sections"] = list(view.conv_sections)
    if view.interior is not None:
        doc["interior"] = view.interior.to_json()
    if view.per_request:
        doc["per_request"] = True
    return doc


def render_pool(pool: Pool) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "pool_id": pool.pool_id,
        "slot_bytes": pool.slot_bytes,
        "slot_stride": pool.slot_stride,
        "num_slots": pool.num_slots,
    }
    if pool.memory is not None:
        doc["memory"] = dict(pool.memory)
    return doc


def render_registration(reg: RankRegistration, *, geometry_only: bool = False) -> dict[str, Any]:
    """The registration document (docs/geometry.md); ``geometry_only`` drops what cannot change a plan (lease, memory, endpoints)."""
    doc: dict[str, Any] = {
        "role": reg.role.value,
        "tp_size": reg.tp_size,
        "tp_rank": reg.tp_rank,
        "pp_size": reg.pp_size,
        "pp_rank": reg.pp_rank,
        "attention_dp": reg.attention_dp,
        "dp_size": reg.dp_size,
        "dp_rank": reg.dp_rank,
        "cp_size": reg.cp_size,
        "layers_per_stage": list(reg.layers_per_stage),
        "num_draft_layers": reg.num_draft_layers,
        "tokens_per_block": reg.tokens_per_block,
        "attention": {
            "num_kv_heads": reg.attention.num_kv_heads,
            "head_dim": reg.attention.head_dim,
            "dtype": reg.attention.dtype,
            "is_mla": reg.attention.is_mla,
        },
        "pools": [render_pool(pool) for pool in reg.pools],
        "views": [render_view(view) for view in reg.views],
    }
    if reg.cp_size > 1:
        # Only with CP: a document without CP stays byte-identical to what servers before CP
        # accept (they refuse unknown members) and keeps its canonical digest.
        doc.update(
            cp_rank=reg.cp_rank, cp_layout=reg.cp_layout.value, cp_interleave=reg.cp_interleave
        )
    doc.update(render_identity(reg))  # likewise only members that are set
    if geometry_only:
        for pool in doc["pools"]:
            pool.pop("memory", None)
        return doc
    doc["lease_seconds"] = reg.lease_seconds
    if reg.endpoint is not None:
        doc["endpoint"] = reg.endpoint
    if reg.nixl_agent_metadata is not None:
        doc["nixl_agent_metadata"] = reg.nixl_agent_metadata
    return doc | render_topology(reg)  # where it runs: pairing, never a plan
