"""The fan-in bounce gate (docs/geometry.md rule 6).

A receiver may stage a transfer in one contiguous region split equally among its writers only if
every writer contributes the same bytes: one PP stage in the overlap (PP fan-in gives writers
different layer counts), no head duplication on either side of any sharded view pair (an elected
subset of writers carries extra views), no replicated view when several ranks write (its single
elected owner carries extra bytes), equal bytes per block from every writer, and no recurrent
state when several ranks write: state is per request, not per block, so the receiver sizes the region
as blocks x bytes_per_block + the plan's ``state_bytes``, which only a single writer fills in order
(reference 2.8 ``reserve``: a STATE group with more than one writer falls back).

kvroute applies the gate even to a single writer: the reference allows a lone writer through
unconditionally, but a conservative "unsafe" only costs the non-staged path, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def fanin_bounce_safe(
    *,
    pp_stages: int,
    view_pairs: Iterable[tuple[str, int, int]],
    writer_bytes: Sequence[int],
    state: bool = False,
) -> bool:
    """``view_pairs`` holds (mapper, duplicate_head_factor, peer_duplicate_head_factor) per pair,
    state pairs included; ``state`` says the plan moves recurrent state."""
    if pp_stages != 1 or not writer_bytes:
        return False
    if state and len(writer_bytes) > 1:
        return False
    for mapper, dup, peer_dup in view_pairs:
        if mapper == "replicated":
            if len(writer_bytes) > 1:
                return False
        elif dup != 1 or peer_dup != 1:
            return False
    return len(set(writer_bytes)) == 1
