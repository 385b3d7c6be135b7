"""Ranks carry their geometry class (admission by class) and a fence (no heartbeat after a skip).

Revision ID: 3d9e41c7a2b5
Revises: 8c1f2e7a9b3d
Create Date: 2026-12-03 01:00:00+00:00

Existing rows get their class computed from their stored document.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from kvroute.store.migrate import recompute_geometry_classes

revision: str = "3d9e41c7a2b5"
down_revision: str | Sequence[str] | None = "8c1f2e7a9b3d"


def upgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(sa.Column("geometry_class", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("fenced_at", sa.DateTime(timezone=True), nullable=True))
    recompute_geometry_classes(op.get_bind())
    with op.batch_alter_table("ranks") as batch:
        batch.alter_column("geometry_class", existing_type=sa.String(length=64), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("fenced_at")
        batch.drop_column("geometry_class")
