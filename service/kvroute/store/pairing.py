"""A deployment's pairing policy (``geometry.domains``): read by the pairs answer and the matrix,
set by operators. One column of the deployment's row; the deployment must exist (it comes into
being with its first rank, and the policy only orders pairs of ranks that exist)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from kvroute.store.engine import SessionMaker, affected_rows, reading, retry_disconnect
from kvroute.store.errors import NotFound
from kvroute.store.models import DeploymentRow


async def pairing_policy(sessionmaker: SessionMaker, deployment: str) -> dict[str, Any] | None:
    """The stored policy document (None: no policy); ``NotFound`` for an unknown deployment."""

    async def read() -> dict[str, Any] | None:
        async with reading(sessionmaker) as session:
            found = (
                await session.execute(
                    select(DeploymentRow.name, DeploymentRow.pairing).where(
                        DeploymentRow.name == deployment
                    )
                )
            ).first()
        if found is None:
            raise NotFound(f"deployment {deployment!r} does not exist")
        return found.pairing

    return await retry_disconnect(read)


async def set_pairing_policy(
    sessionmaker: SessionMaker, deployment: str, policy: dict[str, Any] | None
) -> None:
    """Stores ``policy`` (None clears it); ``NotFound`` for an unknown deployment."""
    async with sessionmaker.begin() as session:
        changed = await affected_rows(
            session,
            update(DeploymentRow).where(DeploymentRow.name == deployment).values(pairing=policy),
        )
    if changed == 0:
        raise NotFound(f"deployment {deployment!r} does not exist")
