"""KV integrity: the latest canary or digest outcome of each transfer path, and sampled digests.

Revision ID: 9d3b6f1e2a47
Revises: a7c3e5f1b824
Create Date: 2026-12-04 23:40:00+00:00

One row per producer instance x consumer rank, with the registrations it was reported against, and
the producer ranks' digests of sampled requests until their consumers compare
(``kvroute.store.kv_paths``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9d3b6f1e2a47"
down_revision: str | Sequence[str] | None = "a7c3e5f1b824"


def upgrade() -> None:
    op.create_table(
        "kv_paths",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("producer", sa.String(length=63), nullable=False),
        sa.Column("consumer", sa.String(length=63), nullable=False),
        sa.Column("consumer_rank", sa.Integer(), nullable=False),
        sa.Column("producer_generations", sa.JSON(), nullable=False),
        sa.Column("consumer_generation", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("element", sa.JSON(), nullable=True),
        sa.Column("cost_ms", sa.Float(), nullable=True),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("state IN ('attested', 'failed')", name=op.f("ck_kv_paths_state")),
        sa.CheckConstraint("source IN ('canary', 'digest')", name=op.f("ck_kv_paths_source")),
        sa.PrimaryKeyConstraint(
            "deployment", "producer", "consumer", "consumer_rank", name=op.f("pk_kv_paths")
        ),
    )
    op.create_table(
        "kv_digests",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("producer", sa.String(length=63), nullable=False),
        sa.Column("request_id", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("digest", sa.JSON(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "deployment", "producer", "request_id", "rank", name=op.f("pk_kv_digests")
        ),
    )
    op.create_index(op.f("ix_kv_digests_at"), "kv_digests", ["at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_kv_digests_at"), table_name="kv_digests")
    op.drop_table("kv_digests")
    op.drop_table("kv_paths")
