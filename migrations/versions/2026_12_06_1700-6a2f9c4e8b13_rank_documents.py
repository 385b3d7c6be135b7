"""Rank documents move out of ``ranks`` into ``rank_documents``: a heartbeat rewrites its rank's
row, and SQLite rewrites a record whole, its 16 KB document (80 layers) included.

Revision ID: 6a2f9c4e8b13
Revises: 9d3b6f1e2a47
Create Date: 2026-12-06 17:00:00+00:00

Every stored document is copied as it is (same JSON, same key); downgrading copies them back.
On SQLite dropping the column copies ``ranks`` (batch mode); Alembic's connection has foreign keys
off, so dropping the old copy does not cascade to the documents, pools and views.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "6a2f9c4e8b13"
down_revision: str | Sequence[str] | None = "9d3b6f1e2a47"

KEY = ("deployment", "instance", "rank")


def _table(name: str) -> sa.TableClause:
    return sa.table(
        name,
        sa.column("deployment", sa.String),
        sa.column("instance", sa.String),
        sa.column("rank", sa.Integer),
        sa.column("document", sa.JSON),
    )


def upgrade() -> None:
    op.create_table(
        "rank_documents",
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            list(KEY),
            [f"ranks.{column}" for column in KEY],
            name=op.f("fk_rank_documents_deployment_instance_rank_ranks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(*KEY, name=op.f("pk_rank_documents")),
    )
    ranks, documents = _table("ranks"), _table("rank_documents")
    op.execute(
        documents.insert().from_select(
            [*KEY, "document"], sa.select(*(ranks.c[name] for name in (*KEY, "document")))
        )
    )
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("document")


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(sa.Column("document", sa.JSON(), nullable=True))
    ranks, documents = _table("ranks"), _table("rank_documents")
    same_rank = sa.and_(*(documents.c[name] == ranks.c[name] for name in KEY))
    op.execute(
        ranks.update().values(
            document=sa.select(documents.c.document).where(same_rank).scalar_subquery()
        )
    )
    with op.batch_alter_table("ranks") as batch:
        batch.alter_column("document", existing_type=sa.JSON(), nullable=False)
    op.drop_table("rank_documents")
