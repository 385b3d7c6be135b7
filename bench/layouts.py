"""Per-rank random layouts for the benchmarks: one geometry, laid out differently by every rank.

Different engine versions, allocators and pool-sharing schemes place the same layer regions
differently inside a slot. ``relayout`` redraws a registration document's placement while keeping
its geometry: layer regions in a shuffled order with occasional gaps, a slot padded past its last
region and a stride padded to an alignment, views listed in another order under other view ids and
pools under other pool ids. Peer verdicts must not change; plans do (their fragments follow the
offsets).
"""

from __future__ import annotations

import random
from typing import Any

GAPS = (0, 0, 0, 0, 256, 4096)  # bytes left free before a region
STRIDE_ALIGNMENTS = (1, 4096, 65536, 2 << 20)


def relayout(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A copy of ``doc`` with its regions, ids and slot sizes redrawn from ``rng``."""
    views = [dict(view) for view in doc["views"]]
    pool_ids = _renumbered([pool["pool_id"] for pool in doc["pools"]], rng)
    view_ids = _renumbered([view["view_id"] for view in views], rng)
    pools = []
    for pool in doc["pools"]:
        members = [view for view in views if view["pool_id"] == pool["pool_id"]]
        slot_bytes = _place(members, rng)
        alignment = rng.choice(STRIDE_ALIGNMENTS)
        stride = -(-(slot_bytes + rng.choice(GAPS)) // alignment) * alignment
        pools.append(
            {
                **pool,
                "pool_id": pool_ids[pool["pool_id"]],
                "slot_bytes": slot_bytes,
                "slot_stride": stride,
            }
        )
    for view in views:
        view["pool_id"] = pool_ids[view["pool_id"]]
        view["view_id"] = view_ids[view["view_id"]]
    rng.shuffle(views)
    return {**doc, "pools": pools, "views": views}


def _place(views: list[dict[str, Any]], rng: random.Random) -> int:
    """Lays the views' regions out back to back in a shuffled order; returns the slot's bytes."""
    regions = [(view, index) for view in views for index in range(len(view["layers"]))]
    rng.shuffle(regions)
    layers = {id(view): [dict(slot) for slot in view["layers"]] for view in views}
    cursor = 0
    for view, index in regions:
        cursor += rng.choice(GAPS)
        layers[id(view)][index]["offset"] = cursor
        cursor += view["bytes_per_layer"]
    for view in views:
        view["layers"] = layers[id(view)]
    return cursor + rng.choice(GAPS)


def _renumbered(ids: list[int], rng: random.Random) -> dict[int, int]:
    fresh = rng.sample(range(4 * len(ids) + 4), len(ids))
    return dict(zip(ids, fresh, strict=True))
