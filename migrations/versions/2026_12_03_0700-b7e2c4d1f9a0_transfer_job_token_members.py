"""Transfer jobs remember the request's token members: its range, first tokens, state slots and
prompt length, so a job's answer says what it moved.

Revision ID: b7e2c4d1f9a0
Revises: 3d9e41c7a2b5
Create Date: 2026-12-03 07:00:00+00:00

Existing rows keep NULL: they were block-pair jobs, or their members were not recorded.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b7e2c4d1f9a0"
down_revision: str | Sequence[str] | None = "3d9e41c7a2b5"

COLUMNS = (
    "tokens_start",
    "tokens_end",
    "src_first_token",
    "dst_first_token",
    "src_state_slot",
    "dst_state_slot",
    "prompt_tokens",
)


def upgrade() -> None:
    with op.batch_alter_table("transfer_jobs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("transfer_jobs") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
