"""Admission finds each geometry class's first live rank by index, and fences by expiry.

Revision ID: a7c3e5f1b824
Revises: f2b8d4e6a913
Create Date: 2026-12-03 20:00:00+00:00

Every admission batch used to read and sort the live ranks of the opposite role through
(deployment, role, lease_expires_at), and read every engine lease of the deployment to fence the
expired ones, so registration slowed as the deployment grew. The classes are now walked on
(deployment, role, geometry_class, instance, rank); the fences use (deployment, expiry). The old
index served only admission, and left in place it competes for the walk's plan while the table has
no statistics (a fleet's bring-up).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "a7c3e5f1b824"
down_revision: str | Sequence[str] | None = "f2b8d4e6a913"

OLD_INDEX = "ix_ranks_deployment_role_lease_expires_at"
CLASS_INDEX = "ix_ranks_deployment_role_geometry_class_instance_rank"
FENCE_INDEX = "ix_ranks_deployment_lease_expires_at"
LEASE_INDEX = "ix_engine_leases_deployment_expires_at"


def upgrade() -> None:
    op.drop_index(OLD_INDEX, table_name="ranks")
    op.create_index(FENCE_INDEX, "ranks", ["deployment", "lease_expires_at"])
    op.create_index(
        CLASS_INDEX, "ranks", ["deployment", "role", "geometry_class", "instance", "rank"]
    )
    op.create_index(LEASE_INDEX, "engine_leases", ["deployment", "expires_at"])


def downgrade() -> None:
    op.drop_index(LEASE_INDEX, table_name="engine_leases")
    op.drop_index(CLASS_INDEX, table_name="ranks")
    op.drop_index(FENCE_INDEX, table_name="ranks")
    op.create_index(OLD_INDEX, "ranks", ["deployment", "role", "lease_expires_at"])
