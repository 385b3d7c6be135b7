"""What an admission batch reads besides its own rows: the first live rank of each geometry class.

Admission (``store.admission``) checks a candidate against one representative per geometry class of
the opposite role: the class's first live rank in (instance, rank) order (``geometry.classes``).
Finding them must not cost a read of the role's ranks, which made each admission O(ranks in the
deployment) under the deployment lock: a recursive walk of the (deployment, role, geometry_class,
instance, rank) index finds the classes, and index probes each class's first live rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, String, bindparam, literal, null, select, union_all
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import aliased

from kvroute.geometry import RankRegistration, Role
from kvroute.store.models import RankRow, UTCDateTime
from kvroute.store.registrations import RankAt

RANKS = RankRow.__table__


@dataclass
class Peers:
    """What the batch reads: rows of the candidates' instances and each role's class firsts."""

    # (instance, rank) -> generation, canonical digest, geometry class, lease expiry
    rows: dict[tuple[str, int], tuple[int, str, str, datetime]]
    firsts: dict[Role, dict[str, RankAt]]  # role -> class -> its first live rank


async def read_peers(
    connection: AsyncConnection, candidates: Sequence[RankRegistration], at: datetime
) -> Peers:
    """In one statement: every row of the candidates' instances (live or not), and the first
    live rank (instance, rank order) of each geometry class of each role checked against. The
    probes are scalar subqueries, not joins, so the plan stays right with the default estimates
    of a table growing faster than autovacuum analyzes it (a fleet's bring-up)."""
    roles = tuple(sorted({reg.role.opposite.value for reg in candidates}))
    values = {
        "deployment": candidates[0].deployment,
        "instances": sorted({reg.instance for reg in candidates}),
        "at": at,
    }
    rows = await connection.execute(_peers_statement(roles), values)
    peers = Peers({}, {Role(role): {} for role in roles})
    for instance, rank, role, generation, digest, geometry, expires in rows:
        if digest is None:  # a class's first (its rows carry no digest)
            if instance is not None:  # else: no live rank of the class
                peers.firsts[Role(role)][geometry] = (instance, rank, generation)
        else:
            peers.rows[instance, rank] = (generation, digest, geometry, expires)
    return peers


@functools.cache
def _peers_statement(roles: tuple[str, ...]) -> Any:
    """``read_peers``'s statement, built once per set of roles (building it is milliseconds of
    Python); parameters ``deployment``, ``instances`` and ``at``."""
    deployment: BindParameter[str] = bindparam("deployment")
    own = select(
        RANKS.c.instance,
        RANKS.c.rank,
        RANKS.c.role,
        RANKS.c.generation,
        RANKS.c.canonical_sha256,
        RANKS.c.geometry_class,
        RANKS.c.lease_expires_at,
    ).where(
        RANKS.c.deployment == deployment,
        RANKS.c.instance.in_(bindparam("instances", expanding=True)),
    )
    at = bindparam("at", type_=UTCDateTime())
    return union_all(own, *(_class_firsts(deployment, role, at) for role in roles))


def _class_firsts(deployment: Any, role: str, at: Any) -> Any:
    """Per geometry class of ``role`` in the deployment: (instance, rank, role, generation, NULL,
    class, NULL), the first live rank of the class in (instance, rank) order, or NULLs where the
    class has none. Each class is found by one probe of the (deployment, role, geometry_class,
    instance, rank) index (a recursive walk), its first rank by two more."""
    walk = aliased(RANKS)

    def next_class(above: Any = None) -> Any:
        found = select(walk.c.geometry_class).where(
            walk.c.deployment == deployment, walk.c.role == role
        )
        if above is not None:
            found = found.where(walk.c.geometry_class > above)
        return found.order_by(walk.c.geometry_class).limit(1).scalar_subquery()

    classes = select(next_class().label("geometry_class")).cte(f"classes_{role}", recursive=True)
    classes = classes.union_all(
        select(next_class(classes.c.geometry_class)).where(classes.c.geometry_class.is_not(None))
    )

    def live(probe: Any) -> tuple[Any, ...]:  # each subquery its own alias: no correlation
        return (
            probe.c.deployment == deployment,
            probe.c.role == role,
            probe.c.geometry_class == classes.c.geometry_class,
            probe.c.lease_expires_at > at,
        )

    def first(column: Any, where: Sequence[Any], order: Sequence[Any]) -> Any:
        """The first ``column`` in ``order`` of the rows ``where`` holds, per class."""
        chosen = select(column).where(*where).order_by(*order).limit(1)
        return chosen.correlate(classes).scalar_subquery()

    lowest_instance, lowest_rank, row = aliased(RANKS), aliased(RANKS), aliased(RANKS)
    instance = first(
        lowest_instance.c.instance,
        live(lowest_instance),
        (lowest_instance.c.instance, lowest_instance.c.rank),
    )
    rank = first(
        lowest_rank.c.rank,
        (*live(lowest_rank), lowest_rank.c.instance == instance),
        (lowest_rank.c.rank,),
    )
    ranked = (row.c.deployment == deployment, row.c.instance == instance, row.c.rank == rank)
    generation = first(row.c.generation, ranked, ())  # one row: the rank's key
    return select(
        instance,
        rank,
        literal(role, String()),
        generation,
        null(),
        classes.c.geometry_class,
        null(),
    ).where(classes.c.geometry_class.is_not(None))
