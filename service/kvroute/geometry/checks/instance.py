"""Instance-consistency checks (docs/geometry.md "Rejected at the boundary", 3).

Every rank of an instance agrees with the layout its first rank fixed (TP, PP, layer split, tokens
per block, draft layers, attention defaults) and registers one geometry for the views of a role
class that share layers, whatever their kind: KV heads and bytes, SSM heads, conv sections and
sliding windows alike. The first disagreement is raised, in the order of ``_INSTANCE_FIELDS``.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import Interior, View
from kvroute.geometry.registration.identity import differences

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


# Fields every rank of an instance must agree on, in the order they are compared.
_INSTANCE_FIELDS: tuple[str, ...] = (
    "role",
    "tp_size",
    "pp_size",
    "cp_size",
    "cp_layout",
    "cp_interleave",
    "attention_dp",
    "dp_size",
    "layers_per_stage",
    "tokens_per_block",
    "num_draft_layers",
)
_ATTENTION_FIELDS: tuple[str, ...] = ("num_kv_heads", "head_dim", "dtype", "is_mla")

# Pairs of faces (``face_id``) whose ranks were compared and agreed: a fleet's instances have a
# handful of faces, so a rank joining an instance of 32 compares with its members once per pair of
# faces, not 31 times. Bounded; ids never repeat, so clearing only forgets.
_MEMO_SIZE = 4_096
_face_ids: dict[Hashable, int] = {}
_agreed: set[tuple[int, int]] = set()
_next_id = itertools.count()


def missing_ranks(expected: int, present: Iterable[int]) -> list[int]:
    """The rank numbers of an instance of ``expected`` ranks that ``present`` lacks, in order (a
    plan needs every sender rank, a plan set every receiver rank, a matrix pair both instances)."""
    return sorted(set(range(expected)).difference(present))


def check_instance(reg: RankRegistration, others: Iterable[RankRegistration]) -> None:
    """The rank agrees with its instance's layout (fixed by its first rank) and its rank number."""
    # CP-minor, as TensorRT-LLM's Mapping numbers ranks; pp_rank * tp_size + tp_rank without CP.
    expected_rank = (reg.pp_rank * reg.tp_size + reg.tp_rank) * reg.cp_size + reg.cp_rank
    if reg.rank != expected_rank:
        raise GeometryError(
            "rank_mismatch",
            f"rank {reg.rank} must be (pp_rank * tp_size + tp_rank) * cp_size + cp_rank "
            f"= {expected_rank}",
            field="rank",
            local=reg.rank,
            peer=expected_rank,
            stage="instance",
        )
    for other in sorted(others, key=lambda o: o.rank):
        if other.rank == reg.rank:
            continue
        pair = (reg.instance_face_id, other.instance_face_id)
        if pair not in _agreed:
            _compare_instance_ranks(reg, other)
            if len(_agreed) >= _MEMO_SIZE:
                _agreed.clear()
            _agreed.add(pair)


def face_id(reg: RankRegistration) -> int:
    """A number for everything ``_compare_instance_ranks`` reads of a rank but its name (which only
    its refusals quote): two ranks with the ids of two that agreed agree too."""
    views = tuple(
        (
            view.owner,
            view.roles,
            view.axis,
            view.layer_ids,
            *(mine for _, mine, _ in _view_signature(reg, view, reg, view)),
        )
        for view in reg.views
    )
    face = (
        tuple(getattr(reg, f) for f in _INSTANCE_FIELDS),
        tuple(getattr(reg.attention, f) for f in _ATTENTION_FIELDS),
        reg.model,
        reg.kv_quantization,
        views,
    )
    if (known := _face_ids.get(face)) is not None:
        return known
    if len(_face_ids) >= _MEMO_SIZE:
        _face_ids.clear()
        _agreed.clear()
    return _face_ids.setdefault(face, next(_next_id))


def _compare_instance_ranks(reg: RankRegistration, other: RankRegistration) -> None:
    pairs = [(f, getattr(reg, f), getattr(other, f)) for f in _INSTANCE_FIELDS]
    pairs += [
        (f"attention.{f}", getattr(reg.attention, f), getattr(other.attention, f))
        for f in _ATTENTION_FIELDS
    ]
    # One engine serves one model: its ranks name the same identity, absent members included.
    pairs += [(field, a, b) for _, field, a, b in differences(reg, other, strict=True)]
    for field, mine, theirs in pairs:
        if mine != theirs:
            mine, theirs = _jsonable(mine), _jsonable(theirs)
            raise GeometryError(
                "instance_layout_mismatch",
                f"{field}={mine} disagrees with {other.label()} of the same instance ({field}={theirs})",
                field=field,
                local=mine,
                peer=theirs,
                stage="instance",
                peer_instance=other.instance,
                peer_rank=other.rank,
            )
    _compare_instance_views(reg, other)


def _compare_instance_views(reg: RankRegistration, other: RankRegistration) -> None:
    """Views of one role class that share layers must have one geometry on every rank of the instance."""
    for index, view in enumerate(reg.views):
        for theirs in other.views:
            if (
                theirs.owner is not view.owner
                or theirs.roles != view.roles
                or theirs.axis is not view.axis
                or not view.layer_ids & theirs.layer_ids
            ):
                continue
            for field, a, b in _view_signature(reg, view, other, theirs):
                if a != b:
                    raise GeometryError(
                        "instance_view_mismatch",
                        f"{view.label()} has {field}={a}, but {other.label()} registers {field}={b} "
                        f"for the same layers",
                        field=f"views[{index}].{field}",
                        local=_jsonable(a),
                        peer=_jsonable(b),
                        stage="instance",
                        peer_instance=other.instance,
                        peer_rank=other.rank,
                    )


def _view_signature(
    reg: RankRegistration, view: View, other: RankRegistration, theirs: View
) -> Sequence[tuple[str, object, object]]:
    return (
        ("kind", view.kind.value, theirs.kind.value),
        ("num_kv_heads", reg.heads(view), other.heads(theirs)),
        ("buffers_per_layer", view.buffers_per_layer, theirs.buffers_per_layer),
        ("bytes_per_layer", view.bytes_per_layer, theirs.bytes_per_layer),
        (
            "total_kv_heads",
            view.total_kv_heads or theirs.total_kv_heads,
            theirs.total_kv_heads or view.total_kv_heads,
        ),
        ("ssm_bytes_per_head", view.ssm_bytes_per_head, theirs.ssm_bytes_per_head),
        ("conv_sections", view.conv_sections, theirs.conv_sections),
        ("sliding_window", view.sliding_window, theirs.sliding_window),
        ("interior", view.interior, theirs.interior),
    )


def _jsonable(value: object) -> object:
    if isinstance(value, Interior):
        return value.to_json()
    return list(value) if isinstance(value, tuple) else value
