"""Instances remember their context-parallel size: an instance is whole with tp x pp x cp ranks.
Geometry classes are recomputed, since a rank's face now carries its cp_size (pair checks read it).

Revision ID: c5d8a1e3f702
Revises: 69e7318eb7be
Create Date: 2026-12-03 14:30:00+00:00

Existing instances get cp_size 1: context parallelism was refused at registration before this
revision. Without the recomputed classes admission would stay correct (every stored rank has
cp_size 1, so its old class lies inside one new class) but would check one representative per
old class until every rank registered again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from kvroute.store.migrate import recompute_geometry_classes

revision: str = "c5d8a1e3f702"
down_revision: str | Sequence[str] | None = "69e7318eb7be"


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("cp_size", sa.Integer(), nullable=False, server_default="1"))
    recompute_geometry_classes(op.get_bind())


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("cp_size")
