"""Registration documents for store tests, built programmatically in the shape of docs/geometry.md.

Real-sized defaults (128-dim heads, 32 tokens per block) over the shared factory in
``tests.documents``; the knobs are the ones the store tests need to make ranks compatible or not.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvroute.control.registry import Registry
from kvroute.geometry import RankRegistration
from kvroute.store.engine import SessionMaker
from kvroute.store.records import RegisterOutcome
from kvroute.store.rejections import DEFAULT_LOG_SIZE
from tests.documents import rank_document as shared_rank_document

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def rank_document(
    *,
    total_heads: int = 8,
    head_dim: int = 128,
    tokens_per_block: int = 32,
    num_slots: int = 16,
    **fields: Any,
) -> dict[str, Any]:
    """The shared factory (``tests.documents``) with the store tests' real-sized defaults."""
    return shared_rank_document(
        total_kv_heads=total_heads,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
        num_slots=num_slots,
        **fields,
    )


def registration(deployment: str, instance: str, rank: int, **document: Any) -> RankRegistration:
    """A parsed registration; ``tp_rank`` defaults to ``rank`` (one PP stage)."""
    document.setdefault("tp_rank", rank)
    return RankRegistration.from_json(
        rank_document(**document), deployment=deployment, instance=instance, rank=rank
    )


async def register(
    sessionmaker: SessionMaker,
    reg: RankRegistration,
    *,
    now: datetime,
    rejection_log_size: int = DEFAULT_LOG_SIZE,
) -> RegisterOutcome:
    """Registers ``reg`` through production's path (``control.Registry``: self-checks, the
    deployment's admission queue, a logged refusal), with a fresh process's caches."""
    registry = Registry(sessionmaker, rejection_log_size=rejection_log_size)
    return await registry.register(reg, now=now)
