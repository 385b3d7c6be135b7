"""Self-consistency checks (docs/geometry.md "Rejected at the boundary", 2): what one document must satisfy
on its own. Instance consistency (3) lives in ``instance``.

Each function raises the first GeometryError it finds, in the documented order, so the same bad
document always gets the same answer.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.heads import declared_total_problem
from kvroute.geometry.leaves.parts import CpLayout, Kind, Owner, Role, View
from kvroute.geometry.registration.identity import check_scale_views

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


def _self_error(
    code: str, detail: str, field: str, local: object, peer: object = None
) -> GeometryError:
    return GeometryError(code, detail, field=field, local=local, peer=peer, stage="self")


def check_self(reg: RankRegistration) -> None:
    """Everything a single document must satisfy on its own."""
    _check_layout(reg)
    _check_pools(reg)
    for index, view in enumerate(reg.views):
        _check_view(reg, index, view)
    _check_no_overlap(reg)
    check_scale_views(reg)


def _check_layout(reg: RankRegistration) -> None:
    _check_context_parallel(reg)
    for field, index, size in (
        ("tp_rank", reg.tp_rank, reg.tp_size),
        ("pp_rank", reg.pp_rank, reg.pp_size),
        ("cp_rank", reg.cp_rank, reg.cp_size),
    ):
        if index >= size:
            raise _self_error(
                "rank_out_of_range",
                f"{field}={index} is not below its size {size}",
                field,
                index,
                size,
            )
    if len(reg.layers_per_stage) != reg.pp_size:
        raise _self_error(
            "layers_per_stage_length",
            f"layers_per_stage has {len(reg.layers_per_stage)} entries but pp_size is {reg.pp_size}",
            "layers_per_stage",
            len(reg.layers_per_stage),
            reg.pp_size,
        )
    if reg.num_layers == 0:
        raise _self_error("no_layers", "layers_per_stage sums to 0 layers", "layers_per_stage", 0)
    _check_attention_dp(reg)
    if reg.attention.is_mla and reg.attention.num_kv_heads != 1:
        raise _self_error(
            "mla_heads",
            f"an MLA cache holds one latent head per rank, not {reg.attention.num_kv_heads}",
            "attention.num_kv_heads",
            reg.attention.num_kv_heads,
            1,
        )


def _check_context_parallel(reg: RankRegistration) -> None:
    """Context parallelism kvroute plans: prompt tokens interleaved over the CP ranks, by a
    number of tokens that divides every block size of the rank or is a multiple of it, or split
    in prefill chunks on a context rank (a generation rank must place the tokens it generates,
    which chunks of the prompt have no place for)."""
    if reg.cp_size == 1:
        return
    if reg.chunked:
        if reg.role is Role.GENERATION:
            raise _self_error(
                "context_parallel_layout_unsupported",
                f"cp_layout={reg.cp_layout.value} on a generation rank: contiguous and zig-zag "
                "chunks split a prompt for prefill ring attention and place no token generated "
                "after it; decode context parallelism deals tokens round robin "
                "(cp_layout=interleaved)",
                "cp_layout",
                reg.cp_layout.value,
                CpLayout.INTERLEAVED.value,
            )
        return  # chunks are cut by prompt tokens, whatever the block size: no interleave to check
    n = reg.cp_interleave
    for index, view in enumerate(reg.views):
        tokens = reg.tokens(view)
        if not view.is_state and n % tokens and tokens % n:
            field = (
                "tokens_per_block"
                if view.tokens_per_block is None
                else f"views[{index}].tokens_per_block"
            )
            raise _self_error(
                "cp_interleave_invalid",
                f"cp_interleave={n} neither divides nor is a multiple of {field}={tokens}; "
                "interleaving deals whole blocks or whole parts of one",
                "cp_interleave",
                n,
                tokens,
            )


def _check_attention_dp(reg: RankRegistration) -> None:
    if not reg.attention_dp:
        if (reg.dp_size, reg.dp_rank) != (1, 0):
            raise _self_error(
                "dp_layout_invalid",
                f"dp_size={reg.dp_size}, dp_rank={reg.dp_rank} without attention_dp; expected 1 and 0",
                "dp_size",
                [reg.dp_size, reg.dp_rank],
                [1, 0],
            )
        return
    if reg.tp_size % reg.dp_size:
        raise _self_error(
            "dp_layout_invalid",
            f"dp_size={reg.dp_size} does not divide tp_size={reg.tp_size}",
            "dp_size",
            reg.dp_size,
            reg.tp_size,
        )
    expected = reg.tp_rank // (reg.tp_size // reg.dp_size)
    if reg.dp_rank != expected:
        raise _self_error(
            "dp_layout_invalid",
            f"tp_rank {reg.tp_rank} belongs to attention-DP group {expected}, not dp_rank={reg.dp_rank}",
            "dp_rank",
            reg.dp_rank,
            expected,
        )


def _check_pools(reg: RankRegistration) -> None:
    seen: set[int] = set()
    for index, pool in enumerate(reg.pools):
        if pool.pool_id in seen:
            raise _self_error(
                "duplicate_pool_id",
                f"pool_id {pool.pool_id} appears twice",
                f"pools[{index}].pool_id",
                pool.pool_id,
            )
        seen.add(pool.pool_id)
        if pool.slot_stride < pool.slot_bytes:
            raise _self_error(
                "slot_stride_too_small",
                f"pool {pool.pool_id}: slot_stride {pool.slot_stride} is below slot_bytes {pool.slot_bytes}",
                f"pools[{index}].slot_stride",
                pool.slot_stride,
                pool.slot_bytes,
            )
    view_ids = [view.view_id for view in reg.views]
    if len(set(view_ids)) != len(view_ids):
        dup = next(v for v in view_ids if view_ids.count(v) > 1)
        raise _self_error("duplicate_view_id", f"view_id {dup} appears twice", "views", dup)


def _check_view(reg: RankRegistration, index: int, view: View) -> None:
    field = f"views[{index}]"
    pool = reg.pools_by_id.get(view.pool_id)
    if pool is None:
        raise _self_error(
            "unknown_pool",
            f"{view.label()} names pool {view.pool_id}, which is not registered",
            f"{field}.pool_id",
            view.pool_id,
        )
    _check_view_layers(reg, field, view)
    for slot in view.layers:
        if slot.offset + view.bytes_per_layer > pool.slot_bytes:
            raise _self_error(
                "view_outside_slot",
                f"{view.label()} layer {slot.layer} ends at byte {slot.offset + view.bytes_per_layer}, "
                f"past the {pool.slot_bytes}-byte slot of pool {pool.pool_id}",
                f"{field}.layers",
                slot.offset + view.bytes_per_layer,
                pool.slot_bytes,
            )
    if view.kind.sharded:
        _check_view_heads(reg, field, view)
    elif view.kind.recurrent:
        _check_state_view(field, view)
    elif view.bytes_per_layer % view.buffers_per_layer:
        raise _self_error(
            "bytes_per_layer_not_divisible",
            f"{view.label()}: bytes_per_layer {view.bytes_per_layer} is not divisible by "
            f"buffers_per_layer {view.buffers_per_layer}",
            f"{field}.bytes_per_layer",
            view.bytes_per_layer,
            view.buffers_per_layer,
        )


def _check_view_layers(reg: RankRegistration, field: str, view: View) -> None:
    if len(view.layer_ids) != len(view.layers):
        dup = next(
            s.layer for s in view.layers if [t.layer for t in view.layers].count(s.layer) > 1
        )
        raise _self_error(
            "duplicate_layer", f"{view.label()} lists layer {dup} twice", f"{field}.layers", dup
        )
    if view.owner is Owner.DRAFT:
        bad = sorted(layer for layer in view.layer_ids if layer >= reg.num_draft_layers)
        if bad:
            raise _self_error(
                "draft_layer_out_of_range",
                f"{view.label()} holds draft layers {bad}, but num_draft_layers is {reg.num_draft_layers}",
                f"{field}.layers",
                bad,
                reg.num_draft_layers,
            )
        return
    stage = reg.stage_range
    bad = sorted(layer for layer in view.layer_ids if layer not in stage)
    if bad:
        raise _self_error(
            "layer_outside_stage",
            f"{view.label()} holds layers {bad}, outside PP stage {reg.pp_rank}'s layers "
            f"[{stage.start}, {stage.stop})",
            f"{field}.layers",
            bad,
            [stage.start, stage.stop],
        )


def _check_view_heads(reg: RankRegistration, field: str, view: View) -> None:
    heads = reg.heads(view)
    heads_field = (
        f"{field}.num_kv_heads" if view.num_kv_heads is not None else "attention.num_kv_heads"
    )
    if heads < 1:
        raise _self_error(
            "view_heads_missing",
            f"{view.label()} is sharded by heads but its rank holds {heads} KV heads",
            heads_field,
            heads,
        )
    if reg.attention.is_mla and heads != 1:
        raise _self_error(
            "mla_heads",
            f"MLA {view.label()} holds {heads} heads per rank, not 1",
            heads_field,
            heads,
            1,
        )
    if view.total_kv_heads is not None:
        problem = declared_total_problem(heads, view.total_kv_heads, reg.tp_per_dp)
        if problem:
            code = "tp_heads_not_divisible" if "divide" in problem else "head_count_inconsistent"
            raise _self_error(
                code,
                f"{view.label()}: {problem}",
                f"{field}.total_kv_heads",
                view.total_kv_heads,
                reg.tp_per_dp,
            )
    tokens = reg.tokens(view) if view.kind is Kind.NHD else 1
    unit = view.buffers_per_layer * tokens * heads
    if view.bytes_per_layer % unit:
        what = "buffers x tokens x heads" if view.kind is Kind.NHD else "buffers x heads"
        raise _self_error(
            "bytes_per_layer_not_divisible",
            f"{view.label()}: bytes_per_layer {view.bytes_per_layer} is not divisible by {what} = {unit}",
            f"{field}.bytes_per_layer",
            view.bytes_per_layer,
            unit,
        )
    if view.interior is not None:
        _check_interior(field, view, heads, reg.tokens(view))


def _check_interior(field: str, view: View, heads: int, tokens: int) -> None:
    """An interior tiles whole token rows: one tiling per buffer, planes dividing a token-head's
    row, token groups dividing the block."""
    interior = view.interior
    assert interior is not None
    if len(interior.tilings) != view.buffers_per_layer:
        raise _self_error(
            "interior_tilings_mismatch",
            f"{view.label()}: interior has {len(interior.tilings)} tilings for "
            f"buffers_per_layer={view.buffers_per_layer}",
            f"{field}.interior.tilings",
            len(interior.tilings),
            view.buffers_per_layer,
        )
    per = view.buffers_per_layer * heads * tokens
    row = view.bytes_per_layer // per if view.bytes_per_layer % per == 0 else None
    for index, tiling in enumerate(interior.tilings):
        where = f"{field}.interior.tilings[{index}]"
        if row is None or row % tiling.planes:
            raise _self_error(
                "interior_planes_not_divisible",
                f"{view.label()}: a token-head row of {row or 'no whole number of'} bytes "
                f"cannot be cut into {tiling.planes} planes",
                f"{where}.planes",
                tiling.planes,
                row,
            )
        pieces, chunk = tiling.group_planes, row // tiling.planes
        if pieces > 1 and (tiling.token_group == 1 or chunk % pieces):
            grouped = tiling.token_group > 1
            why = f"cannot cut a plane's {chunk}-byte chunk" if grouped else "needs token_group > 1"
            raise _self_error(
                "interior_group_planes_not_divisible",
                f"{view.label()}: group_planes {pieces} {why}",
                f"{where}.group_planes",
                pieces,
                chunk,
            )
        if tokens % tiling.token_group:
            raise _self_error(
                "interior_token_group_not_divisible",
                f"{view.label()}: {tokens} tokens per block are not whole groups of "
                f"{tiling.token_group}",
                f"{where}.token_group",
                tiling.token_group,
                tokens,
            )


def _check_state_view(field: str, view: View) -> None:
    """A recurrent view is one buffer per layer whose bytes split into whole heads or sections."""
    if view.buffers_per_layer != 1:
        raise _self_error(
            "state_buffers_invalid",
            f"{view.label()}: recurrent state is one region per layer, not "
            f"buffers_per_layer={view.buffers_per_layer}",
            f"{field}.buffers_per_layer",
            view.buffers_per_layer,
            1,
        )
    if view.kind is Kind.SSM:
        unit = view.ssm_bytes_per_head or 1
        if view.bytes_per_layer % unit:
            raise _self_error(
                "bytes_per_layer_not_divisible",
                f"{view.label()}: bytes_per_layer {view.bytes_per_layer} is not a whole number of "
                f"SSM heads of ssm_bytes_per_head={unit} bytes",
                f"{field}.bytes_per_layer",
                view.bytes_per_layer,
                unit,
            )
        return
    sections = view.conv_sections or ()
    if sum(sections) != view.bytes_per_layer:
        raise _self_error(
            "conv_sections_sum_mismatch",
            f"{view.label()}: conv_sections {list(sections)} sum to {sum(sections)} bytes, "
            f"not bytes_per_layer={view.bytes_per_layer}",
            f"{field}.conv_sections",
            sum(sections),
            view.bytes_per_layer,
        )


def _check_no_overlap(reg: RankRegistration) -> None:
    """Views of one slot axis must not overlap. A block view and a state view may: a slot of a
    shared pool holds a KV block or one request's state, never both (the data plane refuses a job
    naming one slot both ways where their regions overlap). Views of different KV cache groups
    (``kv_group``) may too: a block id belongs to one group's block table at a time. A view
    without a group overlaps nothing, so each group is checked together with the ungrouped."""
    named = sorted({view.kv_group for view in reg.views if view.kv_group is not None})
    groups: list[int | None] = [*named] if named else [None]
    for group in groups:
        _check_disjoint([v for v in reg.views if v.kv_group in (group, None)], group)


def _check_disjoint(views: list[View], group: int | None) -> None:
    regions = sorted(
        (
            (view.pool_id, view.axis.value),
            slot.offset,
            slot.offset + view.bytes_per_layer,
            view.view_id,
            slot.layer,
        )
        for view in views
        for slot in view.layers
    )
    for before, after in itertools.pairwise(regions):
        if before[0] == after[0] and after[1] < before[2]:
            raise _self_error(
                "views_overlap",
                f"pool {before[0][0]}: view {before[3]} layer {before[4]} [{before[1]}, {before[2]}) overlaps "
                f"view {after[3]} layer {after[4]} starting at {after[1]}"
                + ("" if group is None else f" (KV cache group {group}, or no kv_group)"),
                "views",
                [before[3], before[4]],
                [after[3], after[4]],
            )
