"""The relational schema of kvroute's registry, shared by the service code and Alembic.

Ranks keep the registration document as given (the source of truth for geometry checks and plans)
in a table of its own, ``rank_documents``: a heartbeat rewrites its rank's row, and SQLite rewrites a
record whole, so a document kept in that row (16 KB for an 80-layer model) would be read and written
again by every renewal. Pools and views are also exploded into their own rows so an admin can ask
geometry questions in plain SQL ("which ranks hold draft layers with 1 KV head?") without parsing
JSON. Keys are the natural names (deployment, instance, rank) rather than surrogate ids for the same
reason.

Every constraint is named through the MetaData naming convention, so later migrations can drop or
alter them identically on SQLite and PostgreSQL.

Each mapped class is named ``...Row``: a row of a table, whose columns the store writes and reads.
The documents the REST API answers about the same things (``wire.Deployment``, ``wire.Instance``,
``wire.Rank``, ``wire.Rejection``, ``wire.TransferJob``) are other shapes, built from rows and
counts by the store, never mapped.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column, relationship

from kvroute.job_state import JobState

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NAME_LENGTH = 63  # the API's name pattern allows at most 63 characters
ROLES = ("context", "generation")


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on every backend.

    SQLite has no timezone type and hands back naive values; storing naive UTC there and tagging
    results as UTC keeps lease comparisons in SQL (ISO strings) and in Python consistent.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: kvroute stores timezone-aware UTC only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)


# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
AutoId = BigInteger().with_variant(Integer(), "sqlite")


def _in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    # Every model here maps one Table (SQLAlchemy types ``__table__`` as any FromClause), so the
    # store's statements may use a model's table as a table: insert(), update(), .c.
    if TYPE_CHECKING:
        __table__: ClassVar[Table]

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute as is
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
        str: String(NAME_LENGTH),
        int: Integer(),
    }


class DeploymentRow(Base):
    __tablename__ = "deployments"

    name: Mapped[str] = mapped_column(primary_key=True)
    created_at: Mapped[datetime]
    # The latest instant a registration was admitted at. Leases are judged no earlier than this, so
    # a heartbeat that arrives late cannot revive a rank that was already not a peer for that admission.
    checked_at: Mapped[datetime]
    # The pairing policy (``geometry.domains.PairingPolicy`` as JSON); None: no policy.
    pairing: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)
    # The revision of the deployment's latest event (``events``), moved under the deployment lock.
    revision: Mapped[int] = mapped_column(BigInteger, server_default="0")


class InstanceRow(Base):
    __tablename__ = "instances"
    __table_args__ = (CheckConstraint(_in("role", ROLES), name="role"),)

    deployment: Mapped[str] = mapped_column(
        ForeignKey("deployments.name", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    tp_size: Mapped[int]
    pp_size: Mapped[int]
    cp_size: Mapped[int] = mapped_column(server_default="1")
    attention_dp: Mapped[bool] = mapped_column(Boolean)
    dp_size: Mapped[int]
    created_at: Mapped[datetime]


class RankRow(Base):
    __tablename__ = "ranks"
    __table_args__ = (
        ForeignKeyConstraint(
            ["deployment", "instance"],
            ["instances.deployment", "instances.name"],
            ondelete="CASCADE",
        ),
        CheckConstraint(_in("role", ROLES), name="role"),
        # Admission: a deployment's expired ranks (the fence), and each geometry class with its
        # first rank in a few probes whatever the deployment's size (``store.admission``).
        Index(None, "deployment", "lease_expires_at"),
        Index(None, "deployment", "role", "geometry_class", "instance", "rank"),
        Index(None, "lease_expires_at"),
        Index(None, "deployment", "engine_lease"),
    )

    deployment: Mapped[str] = mapped_column(primary_key=True)
    instance: Mapped[str] = mapped_column(primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    generation: Mapped[int] = mapped_column(BigInteger)
    lease_seconds: Mapped[int]
    lease_expires_at: Mapped[datetime]
    registered_at: Mapped[datetime]
    canonical_sha256: Mapped[str] = mapped_column(String(64))
    # The rank's geometry class (``RankRegistration.class_digest``): admission checks one rank per
    # class, so ranks of one PP stage of an instance cost one check, not one each.
    geometry_class: Mapped[str] = mapped_column(String(64))
    # Set by an admission that judged this rank expired: a fenced rank is never renewed by a
    # heartbeat (it was not checked against what that admission let in); it must register again.
    fenced_at: Mapped[datetime | None]
    # The engine lease keeping this rank (``EngineLeaseRow.lease_id``), or None for a lease of its
    # own: renewing that lease renews the rank, and its expiry is the rank's.
    engine_lease: Mapped[str | None]
    # The lease expiry an event last reported (``store.events.note_expiries``): each expiry once.
    expiry_noted_at: Mapped[datetime | None]

    # lazy="raise": under asyncio an implicit load would be hidden blocking I/O; load with
    # selectinload. passive_deletes: the database's ON DELETE CASCADE removes the children.
    pools: Mapped[list[PoolRow]] = relationship(lazy="raise", passive_deletes=True)
    views: Mapped[list[ViewRow]] = relationship(lazy="raise", passive_deletes=True)


class _RankPart:
    """A part of a rank's registration (a pool, a view): keyed under the rank's key, and deleted
    with the rank by the database (``ON DELETE CASCADE``)."""

    # sort_order: the rank's key leads the table's columns and its primary key.
    deployment: Mapped[str] = mapped_column(primary_key=True, sort_order=-1)
    instance: Mapped[str] = mapped_column(primary_key=True, sort_order=-1)
    rank: Mapped[int] = mapped_column(primary_key=True, sort_order=-1)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[ForeignKeyConstraint]:
        key = ["deployment", "instance", "rank"]
        return (ForeignKeyConstraint(key, [f"ranks.{c}" for c in key], ondelete="CASCADE"),)


class PoolRow(_RankPart, Base):
    __tablename__ = "pools"

    pool_id: Mapped[int] = mapped_column(primary_key=True)
    slot_bytes: Mapped[int] = mapped_column(BigInteger)
    slot_stride: Mapped[int] = mapped_column(BigInteger)
    num_slots: Mapped[int] = mapped_column(BigInteger)
    # none_as_null: a pool without memory is SQL NULL, not the JSON literal null.
    memory: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class RankDocumentRow(_RankPart, Base):
    """A rank's registration document as given; apart from ``ranks`` so renewals leave it be."""

    __tablename__ = "rank_documents"

    document: Mapped[dict[str, Any]]


class ViewRow(_RankPart, Base):
    __tablename__ = "views"

    view_id: Mapped[int] = mapped_column(primary_key=True)
    pool_id: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    roles: Mapped[list[Any]]
    owner: Mapped[str] = mapped_column(String(16))
    num_kv_heads: Mapped[int | None]
    total_kv_heads: Mapped[int | None]
    buffers_per_layer: Mapped[int]
    bytes_per_layer: Mapped[int] = mapped_column(BigInteger)
    num_layers: Mapped[int]
    first_layer: Mapped[int | None]
    last_layer: Mapped[int | None]
    layers: Mapped[list[Any]]


class EngineLeaseRow(Base):
    """One lease for many ranks (an engine's process group), etcd's model: renewing it renews every
    rank attached to it, and its expiry is theirs. Fenced like a rank by an admission that judged it
    expired; its id is never handed out again, so an expired lease cannot come back."""

    __tablename__ = "engine_leases"
    # By deployment and expiry: admission fences a deployment's expired leases without reading
    # its live ones.
    __table_args__ = (Index(None, "expires_at"), Index(None, "deployment", "expires_at"))

    deployment: Mapped[str] = mapped_column(primary_key=True)
    lease_id: Mapped[str] = mapped_column(primary_key=True)
    lease_seconds: Mapped[int]
    granted_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    fenced_at: Mapped[datetime | None]


class Event(Base):
    """One change of a deployment, numbered by its revision (``kvroute.store.events``)."""

    __tablename__ = "events"

    deployment: Mapped[str] = mapped_column(primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32))
    instance: Mapped[str | None]
    rank: Mapped[int | None]
    generation: Mapped[int | None] = mapped_column(BigInteger)
    # none_as_null: an event without data is SQL NULL, not the JSON literal null.
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class Generation(Base):
    """The last generation handed to each rank identity; outlives the rank row on purpose.

    A rank that is deleted (or reaped) and registers again continues from here, so a plan naming
    an older generation can never be mistaken for a plan of the new registration.
    """

    __tablename__ = "rank_generations"

    deployment: Mapped[str] = mapped_column(primary_key=True)
    instance: Mapped[str] = mapped_column(primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)


class RejectionRow(Base):
    __tablename__ = "rejections"
    __table_args__ = (Index(None, "at"),)

    id: Mapped[int] = mapped_column(AutoId, primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    # Text: a refused document may carry names the schema would never admit into the registry.
    deployment: Mapped[str] = mapped_column(Text)
    instance: Mapped[str] = mapped_column(Text)
    rank: Mapped[int]
    stage: Mapped[str] = mapped_column(String(16))
    code: Mapped[str] = mapped_column(String(128))
    field: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text)
    problem: Mapped[dict[str, Any]]


class TransferJobRow(Base):
    __tablename__ = "transfer_jobs"
    __table_args__ = (
        CheckConstraint(_in("state", tuple(JobState)), name="state"),
        Index(None, "state"),
        Index(None, "replica", "state"),
        Index(None, "deployment", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    deployment: Mapped[str]
    sender: Mapped[str]
    receiver: Mapped[str]
    receiver_ranks: Mapped[list[Any]]
    src_blocks: Mapped[list[Any]]
    dst_blocks: Mapped[list[Any]]
    state: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    fragments: Mapped[int] = mapped_column(BigInteger)
    plan_fingerprint: Mapped[str] = mapped_column(Text)
    # The kvroute replica whose worker pool runs the job (settings.replica_id).
    replica: Mapped[str] = mapped_column(String(128), server_default="")
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    # The request's options as it gave them (None: not given): wire.TransferOptions.
    tokens_start: Mapped[int | None] = mapped_column(BigInteger)
    tokens_end: Mapped[int | None] = mapped_column(BigInteger)
    src_first_token: Mapped[int | None] = mapped_column(BigInteger)
    dst_first_token: Mapped[int | None] = mapped_column(BigInteger)
    src_state_slot: Mapped[int | None] = mapped_column(BigInteger)
    dst_state_slot: Mapped[int | None] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)


class KvPathRow(Base):
    """The latest integrity outcome of one KV transfer path: a producer (context) instance to one
    rank of a consumer (generation) instance (``kvroute.store.kv_paths``). It holds for the
    registrations it was reported against: the producer's live generations and the consumer
    rank's; a re-registration on either side leaves it stale."""

    __tablename__ = "kv_paths"
    __table_args__ = (
        CheckConstraint(_in("state", ("attested", "failed")), name="state"),
        CheckConstraint(_in("source", ("canary", "digest")), name="source"),
    )

    deployment: Mapped[str] = mapped_column(primary_key=True)
    producer: Mapped[str] = mapped_column(primary_key=True)
    consumer: Mapped[str] = mapped_column(primary_key=True)
    consumer_rank: Mapped[int] = mapped_column(primary_key=True)
    # rank (as a string, JSON's keys) -> generation of every live producer rank when reported.
    producer_generations: Mapped[dict[str, Any]]
    consumer_generation: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(16))
    # The first wrong element (layer, head, token, kv, detail); none_as_null: SQL NULL when none.
    element: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    cost_ms: Mapped[float | None] = mapped_column(Float())
    reported_at: Mapped[datetime]


class KvDigestRow(Base):
    """A producer rank's digest of one sampled request, kept until its consumer ranks compare
    (``kvroute.store.kv_paths``); trimmed once older than ``DIGEST_KEEP``."""

    __tablename__ = "kv_digests"
    __table_args__ = (Index(None, "at"),)

    deployment: Mapped[str] = mapped_column(primary_key=True)
    producer: Mapped[str] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[dict[str, Any]]
    at: Mapped[datetime]
