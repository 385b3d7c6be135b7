"""kvroute.geometry: the pure planning core.

Reading path: model (what a rank registers) -> document (its JSON) -> heads (rule 1) -> validate
and instance (self and instance checks) -> matching and pairs (view pairs between peers; window:
sliding windows; state: recurrent state pairs) -> compat (the ordered registration check) -> faces
and classes (what peer checks read of a rank; admission by geometry class) ->
topology, mappers, planner and state_planner (plans) -> spread (context parallelism: which tokens a
CP rank holds) -> periods and rows (plans between blocks of different sizes, CP placements or interiors) -> ranges
(token ranges cut from plans; a window restricts them) -> bounce (rule 6) ->
builder (views for workers). Nothing here does I/O or imports aiohttp, SQLAlchemy or torch.
"""

from kvroute.geometry.checks.compat import check_peers, check_registration
from kvroute.geometry.checks.instance import missing_ranks
from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import HeadOrder, Interior, Tiling
from kvroute.geometry.leaves.spread import Spread
from kvroute.geometry.plans.plan import PeerPlan, Plan, StateTransfer, ViewTransfer
from kvroute.geometry.plans.planner import build_plan
from kvroute.geometry.plans.rows import TokenAxis
from kvroute.geometry.registration.model import (
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
from kvroute.geometry.tokens.periods import PeriodMap
from kvroute.geometry.tokens.ranges import (
    BLOCK_PAIRS,
    BlockList,
    PromptContradiction,
    TokenGap,
    TokenRange,
    TokenRangeError,
    TokenWindow,
    block_ends,
    check_covered,
    first_gap,
    full_periods,
    periods_inside,
    range_copies,
    whole_pieces,
)
from kvroute.geometry.tokens.window import Window, window_start, windowed_range

__all__ = [
    "BLOCK_PAIRS",
    "DTYPE_BITS",
    "Attention",
    "BlockList",
    "GeometryError",
    "HeadOrder",
    "Interior",
    "Kind",
    "LayerSlot",
    "Owner",
    "PeerPlan",
    "PeriodMap",
    "Plan",
    "Pool",
    "PromptContradiction",
    "RankRegistration",
    "Role",
    "Spread",
    "StateTransfer",
    "Tiling",
    "TokenAxis",
    "TokenGap",
    "TokenRange",
    "TokenRangeError",
    "TokenWindow",
    "View",
    "ViewTransfer",
    "Window",
    "block_ends",
    "build_plan",
    "check_covered",
    "check_peers",
    "check_registration",
    "first_gap",
    "full_periods",
    "missing_ranks",
    "periods_inside",
    "range_copies",
    "whole_pieces",
    "window_start",
    "windowed_range",
]
