"""Executable plans written by hand for data-plane tests: ``CopyPlan`` built from its own types
(``PeerCopy``, ``ViewCopy``) and checked exactly as a compiled plan is. A plan document is read by
``Plan.from_json`` and compiled with ``CopyPlan.from_plan``; nothing here parses one."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.transfer import CopyPlan, PeerCopy, ViewCopy
from kvroute.transfer.fragments import fragment_array


def pair(
    fragments: Sequence[Sequence[int]],
    *,
    pool: int = 0,
    mapper: str = "hnd",
    state: bool = False,
) -> ViewCopy:
    """View 0 -> view 0 of ``pool`` on both sides, moving ``fragments`` per slot."""
    return ViewCopy(0, 0, pool, pool, mapper, fragment_array(fragments), state=state)


def copy_plan(
    *peers: tuple[int, Sequence[ViewCopy]] | PeerCopy, fingerprint: str = "hand-written"
) -> CopyPlan:
    """The plan of ``peers`` (``(rank, views)`` or a whole ``PeerCopy``), checked exactly once."""
    built = tuple(
        peer if isinstance(peer, PeerCopy) else PeerCopy(peer[0], True, tuple(peer[1]))
        for peer in peers
    )
    return CopyPlan.checked(fingerprint, built)
