"""Deployments carry their pairing policy: topology domains pairs must share, and preferred ones.

Revision ID: 4e1b7d2a9c60
Revises: e4a7c9b2d610
Create Date: 2026-12-03 17:10:00+00:00

Null (the default for existing deployments) is no policy: every compatible pair is allowed and
pairs are listed by name, as before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "4e1b7d2a9c60"
down_revision: str | Sequence[str] | None = "e4a7c9b2d610"


def upgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("pairing", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("pairing")
