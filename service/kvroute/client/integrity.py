"""KV integrity for workers: the canary of a transfer path and the reports kvroute stores.

A canary is a known pattern in reserved blocks: every byte a function of (row series: owner,
roles, layer, global head, K/V; prompt position; byte in the row), so it is the same logical
tensor on both sides whatever their layouts. The producer writes it through its own layout
(``kv_rows.place_rows``: the layout its kernels read); the consumer pulls those blocks with the
real plan and transport into its own reserved blocks and reads them through *its kernels'* view
of its layout (not what it registered: a registration that lies about the layout is one of the
faults a canary exists to catch), comparing every byte. The first wrong element, in order of
layer, head, token and K/V, names the failure.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvroute.client.kv_digest import Mismatch
from kvroute.client.kv_rows import RowKey, covered_views, place_rows, read_rows
from kvroute.geometry import RankRegistration

MIX = np.uint64(0x9E3779B97F4A7C15)


def canary_tokens(producer: RankRegistration, consumer: RankRegistration) -> range:
    """The canary's prompt positions: the fewest whole blocks of both sides' every block size."""
    sizes = [reg.tokens(view) for reg in (producer, consumer) for view in covered_views(reg)]
    return range(math.lcm(*sizes) if sizes else 0)


def reserved_blocks(reg: RankRegistration, tokens: range) -> list[int]:
    """The blocks a rank keeps for the canary: the last ones of its block pool (an engine gives
    them to no request), in order."""
    views = covered_views(reg)
    if not views:
        return []
    tpb = reg.tokens(views[0])
    slots = min(reg.pools_by_id[view.pool_id].num_slots for view in views)
    count = -(-len(tokens) // tpb)
    if count > slots:
        raise ValueError(f"{reg.label()}: the canary needs {count} blocks, the pool has {slots}")
    return list(range(slots - count, slots))


def pattern(key: RowKey, tokens: range, width: int) -> np.ndarray:
    """``[tokens, width]`` canary bytes of one row series: a multiplicative mix of the series,
    the prompt position and the byte, so a byte from another layer, head, token, K/V or offset
    differs from the one expected (but for a 1-in-256 coincidence per byte, never a whole row)."""
    name = zlib.crc32(f"{key.owner}/{key.roles}".encode())
    series = ((name * 4099 + key.layer) * 8191 + key.head + 1) * 3 + key.buffer
    token = np.arange(tokens.start, tokens.stop, dtype=np.uint64)[:, None]
    byte = np.arange(width, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        mixed = ((np.uint64(series) * MIX + token) * MIX + byte) * MIX
    return (mixed >> np.uint64(56)).astype(np.uint8)


def write_canary(
    reg: RankRegistration, pools: Mapping[int, np.ndarray], blocks: Sequence[int], tokens: range
) -> None:
    """The producer's side: the pattern into ``blocks`` through the rank's layout."""
    shapes = {key: rows.shape[1] for key, rows in read_rows(reg, pools, blocks, tokens)}
    place_rows(
        reg, pools, blocks, tokens, {key: pattern(key, tokens, w) for key, w in shapes.items()}
    )


def check_canary(
    reg: RankRegistration, pools: Mapping[int, np.ndarray], blocks: Sequence[int], tokens: range
) -> Mismatch | None:
    """The consumer's side: the first wrong element of the canary it received in ``blocks``
    (``reg``: the layout its kernels read), or None when every byte is where the pattern says."""
    first: tuple[tuple[int, int, int, int], Mismatch] | None = None
    for key, rows in read_rows(reg, pools, blocks, tokens):
        wrong = np.flatnonzero((rows != pattern(key, tokens, rows.shape[1])).any(axis=1))
        if len(wrong):
            token = tokens.start + int(wrong[0])
            order = (key.layer, key.head, token, key.buffer)
            if first is None or order < first[0]:
                first = (order, Mismatch(key, (token, token + 1)))
    return None if first is None else first[1]


def path_report(
    producer: str,
    consumer: str,
    consumer_rank: int,
    source: str,
    failure: Mismatch | None,
    cost_ms: float | None = None,
) -> dict[str, Any]:
    """The body of ``POST .../kv-paths`` for one outcome."""
    report: dict[str, Any] = {
        "producer": producer,
        "consumer": consumer,
        "consumer_rank": consumer_rank,
        "state": "attested" if failure is None else "failed",
        "source": source,
    }
    if failure is not None:
        element = failure.to_json()
        if element["token_end"] == element["token"] + 1:
            del element["token_end"]
        report["element"] = element
    if cost_ms is not None:
        report["cost_ms"] = round(cost_ms, 3)
    return report
