"""KV integrity for workers: the canary of a transfer path and the reports kvroute stores.

A canary is a known pattern in reserved blocks: every byte a function of (row series: owner,
roles, layer, global head, K/V; prompt position; byte in the row), so it is the same logical
tensor on both sides whatever their layouts. The producer writes it through its own layout
(``kv_rows.place_rows``: the layout its kernels read); the consumer pulls those blocks with the
real plan and transport into its own reserved blocks and reads them through *its kernels'* view
of its layout (not what it registered: a registration that lies about the layout is one of the
faults a canary exists to catch), comparing every byte. The first wrong element, in order of
layer, head, token and K/V, names the failure.

A windowed view is checked over the tokens the pair moves (``kv_rows.window_firsts`` with the
producer's ranks). Recurrent state has its own canary: a state slot each side keeps back
(``reserved_state_slot``), every byte a function of (owner, roles, state kind, layer, section,
global unit: SSM head or conv part, byte in the unit), moved with the plan's state transfers as a
job's state slot pair and checked unit by unit (``kv_state``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from kvroute.client.kv_digest import Mismatch
from kvroute.client.kv_rows import (
    RequestKv,
    RowKey,
    covered_views,
    place_held_rows,
    read_held_rows,
)
from kvroute.client.kv_state import StateKey, place_state, read_state, state_views
from kvroute.geometry import RankRegistration

MIX = np.uint64(0x9E3779B97F4A7C15)


def canary_tokens(producer: RankRegistration, consumer: RankRegistration) -> range:
    """The canary's prompt positions: the fewest whole blocks of both sides' every block size."""
    sizes = [reg.tokens(view) for reg in (producer, consumer) for view in covered_views(reg)]
    return range(math.lcm(*sizes) if sizes else 0)


def reserved_blocks(reg: RankRegistration, tokens: range) -> list[int]:
    """The blocks a rank keeps for the canary: the last ones of its block pool (an engine gives
    them to no request), in order; with context parallelism, the local blocks of the CP rank of
    its TP position holding most of the canary's tokens (one list serves them all)."""
    views = [view for view in reg.views if not view.is_state]
    if not views:
        return []
    tpb = reg.tokens(views[0])
    slots = min(reg.pools_by_id[view.pool_id].num_slots for view in views)
    count = reg.placement(tokens.stop).last_block_end(tokens.stop, tpb)
    if count > slots:
        raise ValueError(f"{reg.label()}: the canary needs {count} blocks, the pool has {slots}")
    return list(range(slots - count, slots))


def reserved_state_slot(reg: RankRegistration, tokens: range) -> int | None:
    """The state slot a rank keeps for the canary (None: it has no state): the slot just before
    the canary's blocks at the rank's tokens per block (``reserved_blocks``), in a pool of its own
    too, so every rank of an instance names the same slot whether its pools are shared or not."""
    views = state_views(reg)
    if not views:
        return None
    slots = min(reg.pools_by_id[view.pool_id].num_slots for view in views)
    slot = slots - 1 - -(-len(tokens) // reg.tokens_per_block)
    if slot < 0:
        raise ValueError(f"{reg.label()}: no state slot is left for the canary")
    return slot


def pattern(key: RowKey, tokens: Sequence[int] | np.ndarray, width: int) -> np.ndarray:
    """``[tokens, width]`` canary bytes of one row series at prompt positions ``tokens``: a
    multiplicative mix of the series, the prompt position and the byte, so a byte from another
    layer, head, token, K/V or offset differs from the one expected (but for a 1-in-256
    coincidence per byte, never a whole row)."""
    name = zlib.crc32(f"{key.owner}/{key.roles}".encode())
    series = ((name * 4099 + key.layer) * 8191 + key.head + 1) * 3 + key.buffer
    token = np.asarray(tokens, dtype=np.uint64).reshape(-1, 1)
    return _mix(series, token, np.arange(width, dtype=np.uint64)[None, :])


def state_pattern(key: StateKey, size: int) -> np.ndarray:
    """``[size]`` canary bytes of one state unit: a mix of the unit (kind, layer, section, global
    head or part) and the byte in it, the same on every side whatever its TP."""
    name = zlib.crc32(f"{key.owner}/{key.roles}/{key.kind}".encode())
    series = ((name * 4099 + key.layer) * 131 + key.section) * 1048583 + key.unit + 1
    return _mix(series, np.zeros(1, dtype=np.uint64), np.arange(size, dtype=np.uint64))


def filler(pool: int, first: int, end: int) -> np.ndarray:
    """Bytes ``[first, end)`` of a pool's slot that no view's canary pattern claims: a mix of the
    pool and the byte's offset, so bytes moved from another offset differ (``engines.vllm.canary``
    fills a null block's every view with it before the pattern)."""
    offsets = np.arange(first, end, dtype=np.uint64)
    return _mix(0x5107 + pool, np.zeros(1, dtype=np.uint64), offsets)


class CanaryContent(Protocol):
    """What a checked canary must hold, per logical series (None: not checked)."""

    def rows(self, key: RowKey, held: np.ndarray, width: int) -> np.ndarray | None:
        """The rows of a series at prompt positions ``held``."""

    def state(self, key: StateKey, size: int) -> np.ndarray | None: ...


class Pattern:
    """The content ``write_canary`` writes: ``pattern`` and ``state_pattern``."""

    def rows(self, key: RowKey, held: np.ndarray, width: int) -> np.ndarray | None:
        return pattern(key, held, width)

    def state(self, key: StateKey, size: int) -> np.ndarray | None:
        return state_pattern(key, size)


PATTERN = Pattern()


def _mix(series: int, token: np.ndarray, byte: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        mixed = ((np.uint64(series % 2**64) * MIX + token) * MIX + byte) * MIX
    return (mixed >> np.uint64(56)).astype(np.uint8)


def write_canary(kv: RequestKv) -> None:
    """The producer's side: the pattern into ``kv.blocks`` (and the state canary into
    ``kv.state_slot``) through the rank's layout (a CP rank: the positions it holds)."""
    place_held_rows(kv, pattern)
    if kv.state_slot is not None:
        slot = kv.state_slot
        sizes = {key: len(data) for key, data in read_state(kv.reg, kv.pools, slot)}
        place_state(
            kv.reg, kv.pools, slot, {key: state_pattern(key, n) for key, n in sizes.items()}
        )


def check_canary(kv: RequestKv, content: CanaryContent = PATTERN) -> Mismatch | None:
    """The consumer's side: the first wrong element of the canary it received in ``kv.blocks``
    (``kv.reg``: the layout its kernels read), then in ``kv.state_slot``, or None when every byte
    is what ``content`` says (the pattern, by default). A windowed view is checked from
    ``kv.firsts`` on (the tokens the pair moved: ``kv_rows.window_firsts(reg, len(tokens),
    producer ranks)``)."""
    first: tuple[tuple[int, int, int, int], Mismatch] | None = None
    for key, held, rows in read_held_rows(kv):
        expected = content.rows(key, held, rows.shape[1])
        if expected is None:
            continue
        if expected.shape != rows.shape:  # the sides disagree on the row: wrong from the start
            wrong = np.zeros(1, dtype=np.int64)
        else:
            wrong = np.flatnonzero((rows != expected).any(axis=1))
        if len(wrong):
            token = int(held[wrong].min()) if len(held) else 0
            order = (key.layer, key.head, token, key.buffer)
            if first is None or order < first[0]:
                first = (order, Mismatch(key, (token, token + 1)))
    if first is not None:
        return first[1]
    if kv.state_slot is None:
        return None
    return _check_state(kv.reg, kv.pools, kv.state_slot, content)


def _check_state(
    reg: RankRegistration, pools: Mapping[int, np.ndarray], slot: int, content: CanaryContent
) -> Mismatch | None:
    found = []
    for key, data in read_state(reg, pools, slot):
        expected = content.state(key, len(data))
        if expected is None:
            continue
        if expected.shape != data.shape:
            found.append((key, 0))
        elif len(wrong := np.flatnonzero(data != expected)):
            found.append((key, int(wrong[0])))
    found.sort()
    return Mismatch(found[0][0], byte=found[0][1]) if found else None


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
        if "token" in element and element["token_end"] == element["token"] + 1:
            del element["token_end"]
        report["element"] = element
    if cost_ms is not None:
        report["cost_ms"] = round(cost_ms, 3)
    return report
