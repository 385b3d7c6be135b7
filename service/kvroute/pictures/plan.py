"""A plan as a picture: who writes which receiver head, with a legend, the sizes and the bytes.

Top to bottom: the pair and both instances' TP/PP sizes; the totals; a legend saying what a cell
and its ``rN`` label mean; one row per sender rank heard from (the heads it writes in each view, its
bytes and fragments per block); then one grid per receiver view, columns being the receiver's
heads and rows runs of layers whose writers are the same (a windowed view names its window), and
one grid per recurrent-state view, written once per request slot. Works on the typed plan (a
document is read with ``Plan.from_json`` first, at the edge that received it).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.geometry import Plan, StateTransfer, ViewTransfer
from kvroute.pictures.period import period_strip
from kvroute.pictures.svg import LINE, Canvas, colour
from kvroute.render import state_shard

CELL = 44
SWATCH = 14
GRID_LEFT = 130


def span(values: Iterable[int]) -> str:
    """``0-3`` for a contiguous run, ``0,2,5`` otherwise, ``-`` for nothing."""
    ordered = sorted(set(values))
    if not ordered:
        return "-"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return str(ordered[0]) if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def _written_heads(view: ViewTransfer) -> list[int]:
    if view.mapper == "replicated":
        return [0]
    low, high = view.dst_heads
    return list(range(low, high))


def _shape(parallel: tuple[int, int]) -> str:
    return f", TP{parallel[0]} PP{parallel[1]}"


def _header(canvas: Canvas, plan: Plan) -> float:
    canvas.text(
        10,
        24,
        f"plan {plan.deployment}: {plan.sender_instance} (context{_shape(plan.sender_parallel)}, "
        f"dp group {plan.sender_dp_rank}) -> {plan.receiver_instance} rank {plan.receiver_rank} "
        f"(generation{_shape(plan.receiver_parallel)})",
        size=14,
        weight="bold",
    )
    heard = len(plan.peers)
    canvas.text(
        10,
        24 + LINE,
        f"{plan.expected_writers} writers of {heard} sender ranks heard; "
        f"{plan.bytes_per_block:,} bytes and {plan.fragments_per_block:,} "
        f"fragments per block; fan-in bounce safe: {plan.fanin_bounce_safe}",
    )
    return 24 + 2 * LINE + 8


def _legend(canvas: Canvas, y: float) -> float:
    canvas.text(10, y, "legend", weight="bold")
    y += 8
    canvas.box(10, y, SWATCH * 2, SWATCH, fill=colour(0))
    canvas.text(10 + SWATCH, y + 11, "r0", size=11, anchor="middle")
    canvas.text(50, y + 11, "cell labelled rN: sender rank N writes that receiver head")
    y += LINE
    canvas.box(10, y, SWATCH * 2, SWATCH, fill="#ffffff")
    canvas.text(10 + SWATCH, y + 11, "-", size=11, anchor="middle")
    canvas.text(50, y + 11, "no sender rank writes it in this plan")
    y += LINE
    canvas.text(
        10,
        y + 11,
        "columns hN: the receiver view's KV heads (global numbers); rows: runs of layers",
    )
    return y + LINE + 14


def _writers(canvas: Canvas, plan: Plan, y: float) -> float:
    canvas.text(
        10,
        y,
        "sender ranks: heads written per receiver view, bytes and fragments per block",
        weight="bold",
    )
    y += 8
    for peer in plan.peers:
        rank = peer.rank
        canvas.box(10, y, SWATCH * 2, SWATCH, fill=colour(rank) if peer.sends else "#ffffff")
        canvas.text(10 + SWATCH, y + 11, f"r{rank}", size=11, anchor="middle")
        writes = ", ".join(
            f"view {view.dst_view} ({view.owner}) "
            + ("all" if view.mapper == "replicated" else f"h{span(_written_heads(view))}")
            for view in peer.views
        )
        state = ", ".join(f"state view {s.dst_view} {state_shard(s)}" for s in peer.states)
        if state:
            state = f"; {state} = {peer.state_bytes:,} bytes per request"
        position = f"tp{peer.tp_rank} pp{peer.pp_rank}"
        if peer.sends:
            line = (
                f"{position} writes {writes or 'no block view'} = "
                f"{peer.bytes_per_block:,} bytes, {peer.descriptors_per_block:,} fragments"
                f"{state}"
            )
        else:
            line = f"{position}: sends nothing (another rank holding the same heads writes them)"
        canvas.text(50, y + 11, line)
        y += LINE
    return y + 14


def _bands(plan: Plan, dst_view: int) -> tuple[list[int], list[tuple[list[int], dict[int, int]]]]:
    """Receiver heads of one view, and runs of layers whose head -> writer mapping is the same."""
    writer: dict[int, dict[int, int]] = {}  # layer -> head -> sender rank
    heads: set[int] = set()
    for peer in plan.peers:
        for view in peer.views:
            if view.dst_view != dst_view:
                continue
            written = _written_heads(view)
            heads.update(written)
            for layer in view.layers:
                writer.setdefault(layer, {}).update(dict.fromkeys(written, peer.rank))
    return sorted(heads), _runs(writer)


def _runs(writer: dict[int, dict[int, int]]) -> list[tuple[list[int], dict[int, int]]]:
    """Runs of consecutive layers whose column -> writer mapping is the same."""
    bands: list[tuple[list[int], dict[int, int]]] = []
    for layer in sorted(writer):
        if bands and bands[-1][1] == writer[layer] and bands[-1][0][-1] == layer - 1:
            bands[-1][0].append(layer)
        else:
            bands.append(([layer], writer[layer]))
    return bands


def _grid(canvas: Canvas, plan: Plan, view_id: int, sample: ViewTransfer, y: float) -> float:
    heads, bands = _bands(plan, view_id)
    replicated = sample.mapper == "replicated"
    title = f"view {view_id} ({sample.owner}, {'+'.join(sample.roles)}, {sample.mapper})"
    if sample.window is not None:
        title += f" window {sample.window.tokens}"
    canvas.text(10, y, title, weight="bold")
    y += 8
    if sample.periodic and not sample.period_map.context_parallel:
        y = period_strip(canvas, sample, y)
    elif sample.periodic:  # context parallel: each writer moves its own tokens
        for peer in plan.peers:
            for view in peer.views:
                if view.dst_view == view_id and view.period_map.spans:
                    canvas.text(10, y + 12, f"from rank {peer.rank}", size=11)
                    y = period_strip(canvas, view, y + 16)
    names = ["all" if replicated else f"h{head}" for head in heads]
    return _cells(canvas, heads, names, "head", bands, y)


def _cells(
    canvas: Canvas,
    columns: list[int],
    names: list[str],
    noun: str,
    bands: list[tuple[list[int], dict[int, int]]],
    y: float,
) -> float:
    """The grid under a view's title: one named column per head (or state position), one row per
    run of layers, each cell coloured and labelled by the sender rank that writes it."""
    for index, name in enumerate(names):
        canvas.text(GRID_LEFT + index * CELL + CELL / 2, y + 12, name, size=11, anchor="middle")
    y += 18
    for layers, mapping in bands:
        canvas.text(10, y + CELL / 2 + 4, f"layers {span(layers)}", size=12)
        for index, column in enumerate(columns):
            rank = mapping.get(column)
            x = GRID_LEFT + index * CELL
            canvas.box(
                x,
                y,
                CELL - 2,
                CELL - 2,
                fill=colour(rank) if rank is not None else "#ffffff",
                title=f"{noun} {column}, layers {span(layers)}: sender rank {rank}",
            )
            label = f"r{rank}" if rank is not None else "-"
            canvas.text(x + CELL / 2 - 1, y + CELL / 2 + 4, label, size=12, anchor="middle")
        y += CELL
    return y + 24


def plan_svg(plan: Plan) -> str:
    """The plan's picture (see the module docstring) as a standalone SVG document."""
    canvas = Canvas()
    y = _header(canvas, plan)
    y = _legend(canvas, y)
    y = _writers(canvas, plan, y)
    views = sorted({v.dst_view: v for p in plan.peers for v in p.views}.items())
    for view_id, sample in views:
        y = _grid(canvas, plan, view_id, sample, y)
    states = sorted({s.dst_view: s for p in plan.peers for s in p.states}.items())
    for view_id, state in states:
        y = _state_grid(canvas, plan, view_id, state, y)
    return canvas.render()


def _state_bands(
    plan: Plan, dst_view: int
) -> tuple[list[int], list[tuple[list[int], dict[int, int]]]]:
    """Receiver shard positions of one state view, and layer runs with one position -> writer."""
    writer: dict[int, dict[int, int]] = {}
    units: set[int] = set()
    for peer in plan.peers:
        for state in peer.states:
            if state.dst_view == dst_view:
                written = range(*state.dst_shard)
                units.update(written)
                for layer in state.layers:
                    writer.setdefault(layer, {}).update(dict.fromkeys(written, peer.rank))
    return sorted(units), _runs(writer)


def _state_grid(canvas: Canvas, plan: Plan, view_id: int, sample: StateTransfer, y: float) -> float:
    """A recurrent-state view, written once per request slot: columns are the receiver's shard
    positions (SSM heads hN, or parts pN of every conv section), rows runs of layers."""
    units, bands = _state_bands(plan, view_id)
    unit = sample.shard_unit
    canvas.text(
        10,
        y,
        f"state view {view_id} ({sample.owner}, {'+'.join(sample.roles)}, "
        f"{sample.mapper}, per request)",
        weight="bold",
    )
    y += 8
    prefix = {"head": "h", "part": "p"}.get(unit)
    names = [f"{prefix}{position}" if prefix else "all" for position in units]
    return _cells(canvas, units, names, f"state {unit}", bands, y)
