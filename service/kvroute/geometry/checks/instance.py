"""Instance-consistency checks (docs/geometry.md "Rejected at the boundary", 3).

Every rank of an instance agrees with the layout its first rank fixed (TP, PP, layer split, tokens
per block, draft layers, attention defaults) and registers one geometry for the views of a role
class that share layers, whatever their kind: KV heads and bytes, SSM heads, conv sections and
sliding windows alike. The first disagreement is raised, in the order of ``faces.INSTANCE_FIELDS``.

A caller checking many ranks (admission) keeps the pairs of instance digests
(``faces.instance_digest``) whose ranks agreed in an ``InstanceMemo`` it owns: a fleet's instances have a handful of faces, so a rank
joining an instance of 32 compares with its members once per pair of faces, not 31 times. Only
agreements are kept: a refusal is recomputed every time, so it always names the rank it quotes.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import Interior
from kvroute.geometry.registration.faces import (
    ATTENTION_FIELDS,
    INSTANCE_FIELDS,
    view_signature,
)
from kvroute.geometry.registration.identity import differences

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration

# Pairs of instance digests whose ranks were compared and agreed (the value is always True).
InstanceMemo = MutableMapping[tuple[str, str], bool]


def missing_ranks(expected: int, present: Iterable[int]) -> list[int]:
    """The rank numbers of an instance of ``expected`` ranks that ``present`` lacks, in order (a
    plan needs every sender rank, a plan set every receiver rank, a matrix pair both instances)."""
    return sorted(set(range(expected)).difference(present))


def check_instance(
    reg: RankRegistration, others: Iterable[RankRegistration], agreed: InstanceMemo | None = None
) -> None:
    """The rank agrees with its instance's layout (fixed by its first rank) and its rank number;
    ``agreed``: the caller's memo of faces that agreed (None: compare every rank)."""
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
        pair = (reg.instance_digest, other.instance_digest)
        if agreed is not None and pair in agreed:
            continue
        _compare_instance_ranks(reg, other)
        if agreed is not None:
            agreed[pair] = True


def _compare_instance_ranks(reg: RankRegistration, other: RankRegistration) -> None:
    pairs = [(f, getattr(reg, f), getattr(other, f)) for f in INSTANCE_FIELDS]
    pairs += [
        (f"attention.{f}", getattr(reg.attention, f), getattr(other.attention, f))
        for f in ATTENTION_FIELDS
    ]
    # One engine serves one model: its ranks name the same identity, absent members included.
    pairs += [(field, a, b) for _, field, a, b in differences(reg, other, strict=True)]
    for field, mine, theirs in pairs:
        if mine != theirs:
            mine, theirs = _jsonable(mine), _jsonable(theirs)
            raise GeometryError.against(
                other,
                "instance_layout_mismatch",
                f"{field}={mine} disagrees with {other.label()} of the same instance ({field}={theirs})",
                field=field,
                local=mine,
                theirs=theirs,
                stage="instance",
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
            for field, a, b in view_signature(reg, view, other, theirs):
                if a != b:
                    raise GeometryError.against(
                        other,
                        "instance_view_mismatch",
                        f"{view.label()} has {field}={a}, but {other.label()} registers {field}={b} "
                        f"for the same layers",
                        field=f"views[{index}].{field}",
                        local=_jsonable(a),
                        theirs=_jsonable(b),
                        stage="instance",
                    )


def _jsonable(value: object) -> object:
    if isinstance(value, Interior):
        return value.to_json()
    return list(value) if isinstance(value, tuple) else value
