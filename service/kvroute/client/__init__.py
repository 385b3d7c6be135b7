"""kvroute.client: what a worker imports to talk to kvroute and to describe its KV memory.

Reading path: errors (the one exception) -> models (typed answers) -> retry (backoff policy) -> aio
(the async client; the tokens a transfer moves are one ``TokenWindow``) -> lease (heartbeats,
re-registration) -> sync (blocking facade) -> pools (torch KV tensors -> pools and views; shm and
CUDA IPC memory) -> hybrid (Mamba2 state and attention KV in one pool) -> nixl_descs (plan -> NIXL
descriptor lists, pure) -> nixl_transport (a plan executed with NIXL agents over UCX).

torch and nixl are optional: only ``pools``, ``hybrid``, ``memory`` and ``nixl_transport`` import
them, lazily.
"""

from kvroute.client.aio import AsyncKvrouteClient
from kvroute.client.errors import KvrouteError
from kvroute.client.lease import EngineLeaseKeeper, LeaseKeeper
from kvroute.client.models import (
    TERMINAL_STATES,
    Compatibility,
    CompatibilityPair,
    DeploymentSummary,
    InstanceSummary,
    Lease,
    PlanDocument,
    RankInfo,
    RankSummary,
    Registered,
    Rejection,
    TransferStatus,
)
from kvroute.client.retry import NO_RETRY, RetryPolicy, parse_retry_after
from kvroute.client.sync import KvrouteClient, SyncLease
from kvroute.geometry import RequestBlocks, TokenRange, TokenWindow

__all__ = [
    "NO_RETRY",
    "TERMINAL_STATES",
    "AsyncKvrouteClient",
    "Compatibility",
    "CompatibilityPair",
    "DeploymentSummary",
    "EngineLeaseKeeper",
    "InstanceSummary",
    "KvrouteClient",
    "KvrouteError",
    "Lease",
    "LeaseKeeper",
    "PlanDocument",
    "RankInfo",
    "RankSummary",
    "Registered",
    "Rejection",
    "RequestBlocks",
    "RetryPolicy",
    "SyncLease",
    "TokenRange",
    "TokenWindow",
    "TransferStatus",
    "parse_retry_after",
]
