"""kvroute.geometry: the pure planning core, in five layers, each importing only those before it
(tests/unit/test_layering_geometry.py holds them to it):

- leaves: errors, limits, the parts of a registration, head and CP placement arithmetic
- tokens: token ranges, periods between block sizes, sliding windows
- registration: the registration model, its document, digests and faces
- checks: self, instance and peer checks, admission by geometry class
- plans: mappers, plans and the planner

Each layer's docstring gives its reading path. This package re-exports the public names; nothing
here does I/O or imports aiohttp, SQLAlchemy or torch, and no check keeps state between calls
(memos are the caller's: ``checks.instance.InstanceMemo``, ``checks.classes.VerdictMemo``).
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
from kvroute.geometry.tokens.requests import RequestBlocks
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
    "RequestBlocks",
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
