"""Engine leases: one lease renews and expires many ranks (an engine's process group).

Revision ID: e4a7c9b2d610
Revises: c5d8a1e3f702
Create Date: 2026-12-03 17:00:00+00:00

Existing ranks keep their own leases (``engine_lease`` NULL).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e4a7c9b2d610"
down_revision: str | Sequence[str] | None = "c5d8a1e3f702"


def upgrade() -> None:
    op.create_table(
        "engine_leases",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("lease_id", sa.String(length=63), nullable=False),
        sa.Column("lease_seconds", sa.Integer(), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fenced_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("deployment", "lease_id", name=op.f("pk_engine_leases")),
    )
    op.create_index(op.f("ix_engine_leases_expires_at"), "engine_leases", ["expires_at"])
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(sa.Column("engine_lease", sa.String(length=63), nullable=True))
        batch.create_index(
            batch.f("ix_ranks_deployment_engine_lease"), ["deployment", "engine_lease"]
        )


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.drop_index(batch.f("ix_ranks_deployment_engine_lease"))
        batch.drop_column("engine_lease")
    op.drop_index(op.f("ix_engine_leases_expires_at"), table_name="engine_leases")
    op.drop_table("engine_leases")
