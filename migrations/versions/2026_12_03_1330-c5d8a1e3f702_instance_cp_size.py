"""Instances remember their context-parallel size: an instance is whole with tp x pp x cp ranks.

Revision ID: c5d8a1e3f702
Revises: b7e2c4d1f9a0
Create Date: 2026-12-03 13:30:00+00:00

Existing rows get 1: context parallelism was refused at registration before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c5d8a1e3f702"
down_revision: str | Sequence[str] | None = "b7e2c4d1f9a0"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("cp_size", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("cp_size")
