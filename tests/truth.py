"""The independent ground truth of planner and data-plane tests: what every byte of a pool holds.

Every logical byte has a unique id, named by its view class, prompt position (token), layer, buffer,
global head and byte within the token-head, so the two sides may cut the prompt into blocks of any
size and a byte still has one id wherever it lands. Recurrent state is named by the request instead
of a position (and by section or SSM head). The bytes a receiver expects after a transfer come from
the same first principles: rule 1 (``world.true_heads``), the token range, and for sliding windows
the rule of issue 12 written out here again (``window_starts``), never by the planner's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tests.world import Layout, Side, ViewClass, side_window, true_heads


def window_starts(
    ctx: Side, gen: Side, classes: list[ViewClass], prompt_tokens: int
) -> dict[int, int]:
    """class -> the first prompt position a windowed class's pair moves, for a prompt of
    ``prompt_tokens``: the pair moves the smaller window ``W``, from the latest block start of
    either side at or before ``prompt_tokens + 1 - W`` (``_block_start``); a one-token window
    moves none."""
    starts = {}
    for c, cls in enumerate(classes):
        declared = [side_window(side, c, cls) for side in (ctx, gen)]
        windows = [w for w in declared if w is not None]
        if cls.is_state or not windows:
            continue
        first = prompt_tokens + 1 - min(windows)
        if first >= prompt_tokens:
            starts[c] = Truth.MAX_POSITIONS  # nothing of the prompt
            continue
        starts[c] = max(_block_start(side, max(0, first), prompt_tokens) for side in (ctx, gen))
    return starts


def _block_start(side: Side, first: int, prompt_tokens: int) -> int:
    """A side's latest block start at or before ``first``: the block holding ``first`` without
    context parallelism; with it, the first position from which every CP rank's positions lie in
    the earliest local block any CP rank holds a position from ``first`` on in (by brute force)."""
    tokens = side.tokens_per_block
    if side.cp_size == 1:
        return first - first % tokens
    bound = prompt_tokens if side.chunked else Truth.MAX_POSITIONS
    local = {t: side.holder(t)[1] for t in range(bound)}
    block = min(at for t, at in local.items() if t >= first) // tokens
    earlier = [t for t, at in local.items() if at < block * tokens]
    return max(earlier) + 1 if earlier else 0


class Truth:
    """Byte contents from the logical tensor (see the module docstring)."""

    MAX_POSITIONS = 512

    def __init__(self, classes: list[ViewClass]) -> None:
        self.classes = classes
        # The byte index's radix fits the widest unit or conv section, so ids stay unique.
        self.unit_radix = max(max((c.unit, *c.sections)) for c in classes)

    def logical_id(
        self,
        c: int,
        position: np.ndarray | int,
        layer: int,
        buf: int,
        head: np.ndarray | int,
        k: np.ndarray,
    ) -> np.ndarray:
        """``position`` is a prompt position, or a request for recurrent state."""
        slot = (((c * self.MAX_POSITIONS + position) * 64 + layer) * 4 + buf) * 64 + head
        return slot * self.unit_radix + k + 1

    def fill(
        self,
        side: Side,
        layout: Layout,
        rank: int,
        blocks: list[int],
        content: list[int],
        *,
        states: Mapping[int, int] | None = None,
    ) -> dict[int, np.ndarray]:
        """Pool arrays (one int64 'byte' per element) of a rank holding logical blocks ``content``
        at ``blocks`` and, for each state slot of ``states``, that request's state."""
        tokens = side.tokens_per_block
        placement = {
            block: logical * tokens for block, logical in zip(blocks, content, strict=True)
        }
        return self.place(side, layout, rank, placement, states=states)

    def place(
        self,
        side: Side,
        layout: Layout,
        rank: int,
        placement: dict[int, int],
        positions: range | None = None,
        into: dict[int, np.ndarray] | None = None,
        *,
        starts: Mapping[int, int] | None = None,
        states: Mapping[int, int] | None = None,
    ) -> dict[int, np.ndarray]:
        """Pool arrays of a rank whose slot ``s`` holds the block starting at prompt position
        ``placement[s]``; only ``positions`` are written (every position when None), and of a
        class in ``starts`` only positions from its start on, into copies of ``into`` (zeros when
        None). State slot ``s`` of ``states`` holds request ``states[s]``'s state."""
        arrays = {
            pool: np.zeros(stride * slots, dtype=np.int64) if into is None else into[pool].copy()
            for pool, (_, stride, slots) in layout.pools.items()
        }
        _, tp_rank, cp_rank = side.position(rank)
        q = tp_rank % side.tp_per_dp
        slots = np.array(sorted(placement), dtype=np.int64)
        first = np.array([placement[s] for s in sorted(placement)], dtype=np.int64)
        for (c, layer), (pool, offset) in layout.regions.items():
            cls, stride = self.classes[c], layout.pools[pool][1]
            if cls.is_state:
                for slot, request in (states or {}).items():
                    at, ids = self._state(c, cls, side, q * side.cp_size + cp_rank, layer, request)
                    arrays[pool][slot * stride + offset + at] = ids
                continue
            low = (starts or {}).get(c, 0)
            keep = range(max(low, 0 if positions is None else positions.start), self.MAX_POSITIONS)
            if positions is not None:
                keep = range(keep.start, positions.stop)
            placed = (slots, first, cp_rank)
            self._blocks(arrays[pool], side, c, layer, q, placed, (stride, offset), keep)
        return arrays

    def _blocks(
        self,
        array: np.ndarray,
        side: Side,
        c: int,
        layer: int,
        q: int,
        placed: tuple[np.ndarray, np.ndarray, int],
        where: tuple[int, int],
        keep: range,
    ) -> None:
        """Writes one layer region of a block class into every placed slot, positions in ``keep``;
        a slot's start is a local position of CP rank ``placed[2]`` (the prompt position without
        context parallelism)."""
        cls, (slots, starts, cp_rank), (stride, offset) = self.classes[c], placed, where
        heads = np.array(
            [0] if cls.kind == "replicated" else true_heads(cls.total_heads, side.tp_per_dp, q)
        )
        h, t, u = len(heads), side.tokens_per_block, cls.unit
        n, j, tok, k = np.ogrid[: len(slots), :h, :t, :u]
        prompt = side.prompt_position(cp_rank, starts[n] + tok)
        shape = (len(slots), h, t, u)
        mask = np.broadcast_to((prompt >= keep.start) & (prompt < keep.stop), shape)
        assert (prompt < self.MAX_POSITIONS).all()
        for b in range(cls.buffers):
            position = _in_region(cls.kind, side.interior(c), b, (h, t, u), (j, tok, k))
            at = np.broadcast_to(slots[n] * stride + offset + position, shape)
            ids = np.broadcast_to(self.logical_id(c, prompt, layer, b, heads[j], k), shape)
            array[at[mask]] = ids[mask]

    def _state(
        self, c: int, cls: ViewClass, side: Side, q: int, layer: int, request: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the layer region, ids) of one request's state held by state rank ``q``
        (TP rank x CP size + CP rank)."""
        if cls.kind == "ssm":
            per_rank = cls.total_heads // side.state_tp
            j, k = np.meshgrid(np.arange(per_rank), np.arange(cls.unit), indexing="ij")
            ids = self.logical_id(c, request, layer, 0, q * per_rank + j, k)
            return (j * cls.unit + k).reshape(-1), ids.reshape(-1)
        if cls.kind == "conv":
            positions: list[np.ndarray] = []
            ids: list[np.ndarray] = []
            start = 0
            for section, size in enumerate(cls.sections):
                per_rank = size // side.state_tp
                positions.append(start + np.arange(per_rank))
                # A section's bytes are channel-major and split contiguously over the TP.
                ids.append(
                    self.logical_id(
                        c, request, layer, section, 0, q * per_rank + np.arange(per_rank)
                    )
                )
                start += per_rank
            return np.concatenate(positions), np.concatenate(ids)
        k = np.arange(cls.unit)
        return k, self.logical_id(c, request, layer, 0, 0, k)


def _in_region(
    kind: str,
    interior: tuple[str, tuple[tuple[int, ...], ...]] | None,
    b: int,
    sizes: tuple[int, int, int],
    at: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """Offset in a layer region of byte ``k`` of head ``j``'s token ``tok`` in buffer ``b``: nhd
    token-major, hnd and replicated (one pseudo-head) head-major, and a declared interior as its
    definition says (a head's buffer tile ``[planes][tokens / group][pieces][group][row / (planes x
    pieces)]``: plane ``p`` holds bytes ``[p x row / planes, (p + 1) x row / planes)`` of each
    token; inside a plane, a group of tokens is one run of their chunks cut in ``pieces``, piece by
    piece, token by token inside each)."""
    (h, t, u), (j, tok, k) = sizes, at
    if kind == "nhd":
        return b * h * t * u + tok * (h * u) + j * u + k
    if interior is None:
        return b * h * t * u + j * (t * u) + tok * u + k
    order, tilings = interior
    planes, group, *rest = tilings[b]
    pieces = rest[0] if rest else 1
    buffers = len(tilings)
    tile = (j * buffers + b) * t * u if order == "head_buffer" else (b * h + j) * t * u
    chunk = u // planes
    piece = chunk // pieces
    plane, inside = k // chunk, k % chunk
    run = tile + plane * t * chunk + (tok // group) * group * chunk
    return run + (inside // piece) * group * piece + (tok % group) * piece + inside % piece


def background(layout: Layout) -> dict[int, np.ndarray]:
    """Receiver pools before a transfer: a distinct negative value per byte, never a logical id."""
    return {
        pool: -np.arange(1, stride * slots + 1, dtype=np.int64)
        for pool, (_, stride, slots) in layout.pools.items()
    }


def state_only(truth: Truth, side: Side, layout: Layout, rank: int, slots: Sequence[int]) -> int:
    """How many bytes of a rank's pools the state of the requests in ``slots`` occupies."""
    placed = truth.place(side, layout, rank, {}, states=dict.fromkeys(slots, 5))
    return sum(int((ids != 0).sum()) for ids in placed.values())


def assert_exact(
    out: Mapping[int, np.ndarray],
    writes: Mapping[int, np.ndarray],
    expected: Mapping[int, np.ndarray],
    before: Mapping[int, np.ndarray],
) -> None:
    """Every receiver byte the truth changes was written once with its logical id, and no other
    byte was written (``before``: the pools before the transfer)."""
    for pool, want in expected.items():
        written = (want != before[pool]).astype(np.int64)
        np.testing.assert_array_equal(writes[pool], written, err_msg=f"writes, pool {pool}")
        np.testing.assert_array_equal(out[pool], want, err_msg=f"content, pool {pool}")
