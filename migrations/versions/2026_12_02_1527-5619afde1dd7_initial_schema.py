"""Initial schema: the rank registry, its rejection log and transfer jobs.

Revision ID: 5619afde1dd7
Revises:
Create Date: 2026-12-02 15:27:33.253046+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5619afde1dd7"
down_revision: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployments",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_deployments")),
    )
    op.create_table(
        "rank_generations",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("deployment", "instance", "rank", name=op.f("pk_rank_generations")),
    )
    op.create_table(
        "rejections",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deployment", sa.Text(), nullable=False),
        sa.Column("instance", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("code", sa.String(length=128), nullable=False),
        sa.Column("field", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rejections")),
    )
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rejections_at"), ["at"], unique=False)

    op.create_table(
        "transfer_jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("sender", sa.String(length=63), nullable=False),
        sa.Column("receiver", sa.String(length=63), nullable=False),
        sa.Column("receiver_ranks", sa.JSON(), nullable=False),
        sa.Column("src_blocks", sa.JSON(), nullable=False),
        sa.Column("dst_blocks", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("fragments", sa.BigInteger(), nullable=False),
        sa.Column("plan_fingerprint", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_transfer_jobs_state"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_transfer_jobs")),
    )
    with op.batch_alter_table("transfer_jobs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_transfer_jobs_deployment_created_at"),
            ["deployment", "created_at"],
            unique=False,
        )
        batch_op.create_index(batch_op.f("ix_transfer_jobs_state"), ["state"], unique=False)

    op.create_table(
        "instances",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("tp_size", sa.Integer(), nullable=False),
        sa.Column("pp_size", sa.Integer(), nullable=False),
        sa.Column("attention_dp", sa.Boolean(), nullable=False),
        sa.Column("dp_size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("role IN ('context', 'generation')", name=op.f("ck_instances_role")),
        sa.ForeignKeyConstraint(
            ["deployment"],
            ["deployments.name"],
            name=op.f("fk_instances_deployment_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment", "name", name=op.f("pk_instances")),
    )
    op.create_table(
        "ranks",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("lease_seconds", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("canonical_sha256", sa.String(length=64), nullable=False),
        sa.CheckConstraint("role IN ('context', 'generation')", name=op.f("ck_ranks_role")),
        sa.ForeignKeyConstraint(
            ["deployment", "instance"],
            ["instances.deployment", "instances.name"],
            name=op.f("fk_ranks_deployment_instance_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment", "instance", "rank", name=op.f("pk_ranks")),
    )
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_ranks_deployment_role_lease_expires_at"),
            ["deployment", "role", "lease_expires_at"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_ranks_lease_expires_at"), ["lease_expires_at"], unique=False
        )

    op.create_table(
        "pools",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("slot_bytes", sa.BigInteger(), nullable=False),
        sa.Column("slot_stride", sa.BigInteger(), nullable=False),
        sa.Column("num_slots", sa.BigInteger(), nullable=False),
        sa.Column("memory", sa.JSON(none_as_null=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["deployment", "instance", "rank"],
            ["ranks.deployment", "ranks.instance", "ranks.rank"],
            name=op.f("fk_pools_deployment_instance_rank_ranks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment", "instance", "rank", "pool_id", name=op.f("pk_pools")),
    )
    op.create_table(
        "views",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("view_id", sa.Integer(), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("roles", sa.JSON(), nullable=False),
        sa.Column("owner", sa.String(length=16), nullable=False),
        sa.Column("num_kv_heads", sa.Integer(), nullable=True),
        sa.Column("total_kv_heads", sa.Integer(), nullable=True),
        sa.Column("buffers_per_layer", sa.Integer(), nullable=False),
        sa.Column("bytes_per_layer", sa.BigInteger(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("first_layer", sa.Integer(), nullable=True),
        sa.Column("last_layer", sa.Integer(), nullable=True),
        sa.Column("layers", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment", "instance", "rank"],
            ["ranks.deployment", "ranks.instance", "ranks.rank"],
            name=op.f("fk_views_deployment_instance_rank_ranks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment", "instance", "rank", "view_id", name=op.f("pk_views")),
    )


def downgrade() -> None:
    op.drop_table("views")
    op.drop_table("pools")
    with op.batch_alter_table("ranks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ranks_lease_expires_at"))
        batch_op.drop_index(batch_op.f("ix_ranks_deployment_role_lease_expires_at"))

    op.drop_table("ranks")
    op.drop_table("instances")
    with op.batch_alter_table("transfer_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_transfer_jobs_state"))
        batch_op.drop_index(batch_op.f("ix_transfer_jobs_deployment_created_at"))

    op.drop_table("transfer_jobs")
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rejections_at"))

    op.drop_table("rejections")
    op.drop_table("rank_generations")
    op.drop_table("deployments")
