"""Deployment events: a per-deployment revision and the event log watchers resume from.

Revision ID: f2b8d4e6a913
Revises: 4e1b7d2a9c60
Create Date: 2026-12-03 17:30:00+00:00

Existing deployments start at revision 0; the first expiry scan reports the ranks already expired
(once).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f2b8d4e6a913"
down_revision: str | Sequence[str] | None = "4e1b7d2a9c60"


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("revision", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(sa.Column("expiry_noted_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "events",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("deployment", "revision", name=op.f("pk_events")),
    )


def downgrade() -> None:
    op.drop_table("events")
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("expiry_noted_at")
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("revision")
