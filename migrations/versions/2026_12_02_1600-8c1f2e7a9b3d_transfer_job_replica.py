"""Transfer jobs remember the replica that runs them, so a restart fails only its own.

Revision ID: 8c1f2e7a9b3d
Revises: 5619afde1dd7
Create Date: 2026-12-02 16:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "8c1f2e7a9b3d"
down_revision: str | Sequence[str] | None = "5619afde1dd7"


def upgrade() -> None:
    with op.batch_alter_table("transfer_jobs") as batch:
        batch.add_column(
            sa.Column("replica", sa.String(length=128), server_default="", nullable=False)
        )
        batch.create_index(
            batch.f("ix_transfer_jobs_replica_state"), ["replica", "state"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("transfer_jobs") as batch:
        batch.drop_index(batch.f("ix_transfer_jobs_replica_state"))
        batch.drop_column("replica")
