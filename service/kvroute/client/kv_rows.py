"""A rank's KV in logical order: per (view, layer, global head, K/V) the rows of a token range.

The two sides of a transfer may lay the same logical KV out differently (token-major or head-major,
a K tiled in planes, other block sizes, another TP split); integrity checks compare what each side
holds by *logical* element, so both read their pools through their own registered layout into one
shape: for each ``RowKey`` an array ``[tokens, row bytes]``. ``place_rows`` is the inverse, which a
worker uses to write a known pattern (the canary) through the layout its kernels read.

Covered: block views (hnd with or without a declared interior, nhd, replicated) of a rank without
context parallelism, sliding-window views included: the two sides of one request hold different
extents of a windowed view, so ``window_firsts`` names each windowed view's first held token (by
the geometry's own window rule) and ``read_rows`` reads such a view from there on. Recurrent
state is read per request slot by ``kv_state``. A rank with context parallelism holds only some
prompt positions, at local positions of its own (``Spread``): ``read_held_rows`` and
``place_held_rows`` read and write them for the canary, a prompt from token 0 (digests, which cut
series in chunks of consecutive tokens, still refuse such ranks).

What a rank holds of one request is one ``RequestKv`` (registration, pools, blocks, tokens, the
windowed views' first tokens, the state slot), which the row readers, the canary and the digests
take alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvroute.geometry import Kind, LayerSlot, RankRegistration, View, window_start
from kvroute.geometry.checks.matching import match_view
from kvroute.geometry.checks.pairs import pair_window
from kvroute.geometry.leaves.heads import head_range

REPLICATED_HEAD = -1  # the head a replicated view's rows are keyed by (identical on every rank)


class RowKey(NamedTuple):
    """One logical row series, named the same on both sides of a transfer."""

    owner: str
    roles: str  # the view's roles, sorted and joined by ","
    layer: int
    head: int  # global KV head, or REPLICATED_HEAD
    buffer: int  # 0: K, 1: V (or a view's further buffers)

    def label(self) -> str:
        head = "replicated" if self.head == REPLICATED_HEAD else f"head {self.head}"
        kv = {0: "K", 1: "V"}.get(self.buffer, f"buffer {self.buffer}")
        return f"{self.owner} {self.roles} layer {self.layer} {head} {kv}"


@dataclass(frozen=True, slots=True)
class RequestKv:
    """One request's KV as a rank holds it: ``pools`` are flat uint8 arrays of the rank's pools
    by id, ``blocks`` its block list (block ``blocks[i]`` holds prompt positions ``[i x tpb,
    (i + 1) x tpb)``), ``tokens`` the prompt positions meant, ``firsts`` each windowed view's first
    held token (``window_firsts``; None: every view from ``tokens.start``) and ``state_slot`` the
    request's recurrent-state slot (None: no state)."""

    reg: RankRegistration
    pools: Mapping[int, np.ndarray]
    blocks: Sequence[int]
    tokens: range
    firsts: Mapping[int, int] | None = None
    state_slot: int | None = None


class UnsupportedLayout(ValueError):
    """A rank whose KV cannot be read in logical order here (context parallelism)."""


def covered_views(reg: RankRegistration) -> list[View]:
    if reg.cp_size > 1:
        raise UnsupportedLayout(
            f"{reg.label()}: cp_size={reg.cp_size}; logical KV reads cover ranks without "
            "context parallelism"
        )
    return [v for v in reg.views if not v.is_state and _heads_known(reg, v)]


def window_firsts(
    reg: RankRegistration, prompt_tokens: int, peers: Sequence[RankRegistration] = ()
) -> dict[int, int]:
    """View id -> the first prompt position a windowed view holds of a request whose prompt has
    ``prompt_tokens`` tokens (``prompt_tokens`` itself: none), by the geometry's window rule.

    With ``peers`` (the other side's ranks): what the pair moves, the receiver's tokens
    (``pair_window``'s first token, from the first peer holding the view's layers), and none of a
    view whose peer view the peer leaves out (its heads ambiguous there: it writes no canary and
    sends no digest of it). Without a peer holding the layers: what the rank keeps of its own
    window (its block holding the window's first token on)."""
    firsts: dict[int, int] = {}
    for view in covered_views(reg):
        pair = next(
            ((peer, theirs) for peer in peers if (theirs := match_view(view, reg, peer))), None
        )
        if pair is not None and not _heads_known(*pair):
            firsts[view.view_id] = prompt_tokens
            continue
        window = None if pair is None else pair_window(reg, view, *pair)
        if window is not None:
            first = window.first_token(prompt_tokens)
        elif pair is None and view.sliding_window is not None:
            tpb = reg.tokens(view)
            first = window_start(view.sliding_window, prompt_tokens, tpb, tpb)
        else:
            continue
        firsts[view.view_id] = prompt_tokens if first is None else first
    return firsts


def held_tokens(view: View, tokens: range, firsts: Mapping[int, int] | None) -> range:
    """The part of ``tokens`` a view holds: from its window's first token on (``firsts``)."""
    first = (firsts or {}).get(view.view_id, tokens.start)
    return range(min(max(first, tokens.start), tokens.stop), tokens.stop)


def _heads_known(reg: RankRegistration, view: View) -> bool:
    """Whether the view's global heads follow from its document: one head per rank without a
    declared total may be any of several (heads replicated over the TP), so it is left out rather
    than compared under a guessed name."""
    return (
        view.kind is Kind.REPLICATED
        or view.total_kv_heads is not None
        or reg.heads(view) > 1
        or reg.tp_per_dp == 1
    )


def global_heads(reg: RankRegistration, view: View) -> list[int]:
    if view.kind is Kind.REPLICATED:
        return [REPLICATED_HEAD]
    heads = reg.heads(view)
    total = view.total_kv_heads if view.total_kv_heads is not None else heads * reg.tp_per_dp
    low, high = head_range(total, reg.tp_per_dp, reg.tp_rank_in_group)
    return list(range(low, high))


def _block_span(reg: RankRegistration, view: View, tokens: range) -> tuple[int, int]:
    """(first block index, block count) of the block list covering ``tokens``."""
    tpb = reg.tokens(view)
    first = tokens.start // tpb
    return first, (tokens.stop - 1) // tpb - first + 1


def _regions(pool: np.ndarray, stride: int, offset: int, size: int, slots: int) -> np.ndarray:
    """``[slots, size]`` view of one layer's region in every slot of a flat uint8 pool."""
    return np.lib.stride_tricks.as_strided(
        pool[offset:], shape=(slots, size), strides=(stride, 1), writeable=pool.flags.writeable
    )


def _to_rows(reg: RankRegistration, view: View, region: np.ndarray) -> np.ndarray:
    """``[blocks, bytes_per_layer]`` -> ``[heads, buffers, blocks x tokens, row]`` (a view or copy)."""
    n, b, t = region.shape[0], view.buffers_per_layer, reg.tokens(view)
    h = 1 if view.kind is Kind.REPLICATED else reg.heads(view)
    u = view.bytes_per_layer // (b * h * t)
    if view.kind is Kind.NHD:
        rows = region.reshape(n, b, t, h, u).transpose(3, 1, 0, 2, 4)
        return rows.reshape(h, b, n * t, u)
    interior = view.interior
    if interior is None or interior.trivial:
        return region.reshape(n, b, h, t, u).transpose(2, 1, 0, 3, 4).reshape(h, b, n * t, u)
    tiles = region.reshape(n, h, b, t * u) if interior.heads_outer else None
    buffers = []
    for buf in range(b):
        tile = tiles[:, :, buf] if tiles is not None else region.reshape(n, b, h, t * u)[:, buf]
        tiling = interior.tiling(buf)
        planes, group, pieces = tiling.planes, tiling.token_group, tiling.group_planes
        # [planes][tokens / group][pieces][group][piece]: a token's row is its piece in each of
        # the group's pieces, in each plane, in that order.
        tiled = tile.reshape(n, h, planes, t // group, pieces, group, u // (planes * pieces))
        per_token = tiled.transpose(1, 0, 3, 5, 2, 4, 6)
        buffers.append(per_token.reshape(h, n * t, u))
    return np.stack(buffers, axis=1)


def read_rows(kv: RequestKv) -> Iterator[tuple[RowKey, np.ndarray]]:
    """Each covered row series of ``kv.tokens`` as a C-contiguous ``[tokens, row]`` uint8 array.
    A windowed view in ``kv.firsts`` yields its rows from its first held token on
    (``held_tokens``), none when it holds none of the tokens."""
    reg = kv.reg
    for view in covered_views(reg):
        held = held_tokens(view, kv.tokens, kv.firsts)
        if not held:
            continue
        first, count = _block_span(reg, view, held)
        slots = np.asarray(kv.blocks[first : first + count], dtype=np.int64)
        skip = held.start - first * reg.tokens(view)
        for slot, whole in _layer_regions(kv, view):
            rows = _to_rows(reg, view, whole[slots])[:, :, skip : skip + len(held)]
            for j, buf, key in _series(reg, view, slot.layer):
                yield key, np.ascontiguousarray(rows[j, buf])


def place_rows(kv: RequestKv, content: Mapping[RowKey, np.ndarray]) -> None:
    """Writes ``content[key]`` (``[tokens, row]``) into the rank's pools through its own layout:
    the inverse of ``read_rows`` for every view's whole ``kv.tokens`` (whole blocks only, so no
    write splits a token group; a windowed view's later first token is not written alone)."""
    reg, tokens = kv.reg, kv.tokens
    if kv.firsts:
        raise ValueError("place_rows writes every view from tokens.start; firsts were given")
    for view in covered_views(reg):
        first, count = _block_span(reg, view, tokens)
        tpb = reg.tokens(view)
        if tokens.start % tpb or len(tokens) != count * tpb:
            raise ValueError(f"place_rows writes whole blocks; {tokens} cuts {tpb}-token blocks")
        slots = np.asarray(kv.blocks[first : first + count], dtype=np.int64)
        # Where each logical byte goes: the row shape of an index array, whatever copies it took.
        where = _to_rows(reg, view, np.arange(count * view.bytes_per_layer).reshape(count, -1))
        for slot, whole in _layer_regions(kv, view):
            region = np.zeros(count * view.bytes_per_layer, dtype=np.uint8)
            for j, buf, key in _series(reg, view, slot.layer):
                region[where[j, buf]] = content[key]
            whole[slots] = region.reshape(count, -1)


def roles_of(view: View) -> str:
    return ",".join(sorted(view.roles))


def held_positions(reg: RankRegistration, tokens: range) -> tuple[np.ndarray, np.ndarray]:
    """(prompt positions, local positions) of the ``tokens`` a rank holds, in local order: all of
    them at their own positions without context parallelism; with it, a prompt of
    ``tokens.stop`` tokens from token 0 (chunked layouts place tokens by the prompt's length)."""
    spread = reg.placement(tokens.stop)
    if spread.trivial:
        positions = np.arange(tokens.start, tokens.stop, dtype=np.int64)
        return positions, positions
    if tokens.start:
        raise ValueError(f"{reg.label()}: a CP rank's rows are read from token 0, not {tokens}")
    held = [token for token in tokens if spread.holds(token)]
    local = np.array([spread.local(token) for token in held], dtype=np.int64)
    order = np.argsort(local, kind="stable")
    return np.array(held, dtype=np.int64)[order], local[order]


def read_held_rows(kv: RequestKv) -> Iterator[tuple[RowKey, np.ndarray, np.ndarray]]:
    """Each covered row series as (prompt positions, ``[positions, row]`` uint8 rows): what
    ``read_rows`` yields, with the positions its rows hold, for a CP rank too."""
    if kv.reg.cp_size == 1:
        for key, rows in read_rows(kv):
            yield key, np.arange(kv.tokens.stop - len(rows), kv.tokens.stop), rows
        return
    for view, slots, (positions, local) in _held_views(kv):
        for slot, whole in _layer_regions(kv, view):
            rows = _to_rows(kv.reg, view, whole[slots])
            for j, buf, key in _series(kv.reg, view, slot.layer):
                yield key, positions, np.ascontiguousarray(rows[j, buf][local])


def place_held_rows(
    kv: RequestKv, content: Callable[[RowKey, np.ndarray, int], np.ndarray]
) -> None:
    """Writes ``content(key, positions, row bytes)`` into the rows a rank holds of ``kv.tokens``
    through its layout, leaving every other byte of its blocks as it was (a CP rank's last block
    may be part-filled)."""
    if kv.reg.cp_size == 1:
        widths = {key: rows.shape[1] for key, rows in read_rows(kv)}
        positions = np.arange(kv.tokens.start, kv.tokens.stop)
        place_rows(kv, {key: content(key, positions, width) for key, width in widths.items()})
        return
    for view, slots, (positions, local) in _held_views(kv):
        where = _to_rows(
            kv.reg, view, np.arange(len(slots) * view.bytes_per_layer).reshape(len(slots), -1)
        )
        for slot, whole in _layer_regions(kv, view):
            region = whole[slots].reshape(-1)
            for j, buf, key in _series(kv.reg, view, slot.layer):
                at = where[j, buf][local]  # [held tokens, row]: byte indices in the blocks
                region[at] = content(key, positions, at.shape[1])
            whole[slots] = region.reshape(len(slots), -1)


def _held_views(kv: RequestKv) -> Iterator[tuple[View, np.ndarray, tuple[np.ndarray, np.ndarray]]]:
    """A CP rank's covered views, each with the slots of the local blocks holding its tokens and
    (prompt positions, local positions) of those tokens."""
    positions, local = held_positions(kv.reg, kv.tokens)
    if not len(local):  # a prompt shorter than this rank's first chunk or deal
        return
    for view in [v for v in kv.reg.views if not v.is_state and _heads_known(kv.reg, v)]:
        if view.sliding_window is not None:
            raise UnsupportedLayout(f"{view.label()}: a window's rows on a CP rank")
        count = -(-(int(local.max(initial=-1)) + 1) // kv.reg.tokens(view))
        if count > len(kv.blocks):
            raise ValueError(f"{kv.reg.label()}: its tokens need {count} blocks, {kv.blocks} given")
        yield view, np.asarray(kv.blocks[:count], dtype=np.int64), (positions, local)


def _layer_regions(kv: RequestKv, view: View) -> Iterator[tuple[LayerSlot, np.ndarray]]:
    """Each layer of a view with its region in every slot of the view's pool (``_regions``):
    the slots ``kv.pools`` holds (a stage of some slots holds fewer than the pool)."""
    pool, data = kv.reg.pools_by_id[view.pool_id], kv.pools[view.pool_id]
    for slot in view.layers:
        held = (len(data) - slot.offset - view.bytes_per_layer) // pool.slot_stride + 1
        whole = _regions(data, pool.slot_stride, slot.offset, view.bytes_per_layer,
                         max(0, min(pool.num_slots, held)))  # fmt: skip
        yield slot, whole


def _series(reg: RankRegistration, view: View, layer: int) -> Iterator[tuple[int, int, RowKey]]:
    """(head index on the rank, buffer, key) of each row series one layer of a view holds."""
    roles = roles_of(view)
    for j, head in enumerate(global_heads(reg, view)):
        for buf in range(view.buffers_per_layer):
            yield j, buf, RowKey(view.owner.value, roles, layer, head, buf)
