"""Geometry classes are recomputed: a class is now the digest of a rank's face (what peer checks
read), no longer of its whole document less position, so ranks laid out differently share one.

Revision ID: 69e7318eb7be
Revises: b7e2c4d1f9a0
Create Date: 2026-12-03 13:30:00+00:00

Without it admission would still be correct (every old class lies inside one new class, so a
representative of either kind answers for its members) but would keep checking one representative
per old class until every rank registered again.
"""

from collections.abc import Sequence

from alembic import op

from kvroute.store.migrate import recompute_geometry_classes

revision: str = "69e7318eb7be"
down_revision: str | Sequence[str] | None = "b7e2c4d1f9a0"


def upgrade() -> None:
    recompute_geometry_classes(op.get_bind())


def downgrade() -> None:
    # The previous definition is gone with its code. Rows keep the face digests, which older code
    # reads correctly: its classes are finer, and each of theirs lies inside one of these.
    pass
