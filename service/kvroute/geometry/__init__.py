"""kvroute.geometry: the pure planning core.

Reading path: model (what a rank registers) -> document (its JSON) -> heads (rule 1) -> validate
(self and instance checks) -> matching and pairs (view pairs between peers) -> compat (the ordered
registration check) -> topology, mappers, planner (plans) -> bounce (rule 6) -> builder (views for
workers). Nothing here does I/O or imports aiohttp, SQLAlchemy or torch.
"""

from kvroute.geometry.compat import check_peers, check_registration
from kvroute.geometry.errors import GeometryError
from kvroute.geometry.model import (
    DTYPE_BITS,
    Attention,
    Kind,
    LayerSlot,
    Owner,
    Pool,
    RankRegistration,
    Role,
    View,
)
from kvroute.geometry.plan import PeerPlan, Plan, ViewTransfer
from kvroute.geometry.planner import build_plan

__all__ = [
    "DTYPE_BITS",
    "Attention",
    "GeometryError",
    "Kind",
    "LayerSlot",
    "Owner",
    "PeerPlan",
    "Plan",
    "Pool",
    "RankRegistration",
    "Role",
    "View",
    "ViewTransfer",
    "build_plan",
    "check_peers",
    "check_registration",
]
