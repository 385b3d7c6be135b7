"""Plans for people: a text table and an SVG picture of which sender rank writes which heads.

Both work on the plan JSON document (API.md shape), so the service, the CLI and a worker holding a
fetched plan render the same thing. Nothing here knows how plans are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d37295",
    "#8cd17d",
    "#b6992d",
    "#499894",
    "#f1ce63",
)
STATE_COLUMNS = (
    "sender",
    "view",
    "owner",
    "roles",
    "mapper",
    "mamba tp",
    "writes",
    "layers",
    "bytes/request",
    "fragments",
)
COLUMNS = (
    "sender",
    "sends",
    "view",
    "owner",
    "roles",
    "mapper",
    "heads",
    "layers",
    "bytes/block",
    "fragments",
)


def _heads(view: dict[str, Any]) -> str:
    if view["mapper"] == "replicated":
        return "all"
    lo, hi = view["heads"]["dst"]
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _layers(layers: Sequence[int]) -> str:
    if not layers:
        return "-"
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}" if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def plan_rows(plan: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for peer in plan["peers"]:
        if not peer["views"]:
            rows.append((str(peer["rank"]), "no", "-", "-", "-", "-", "-", "-", "0", "0"))
        for view in peer["views"]:
            rows.append(
                (
                    str(peer["rank"]),
                    "yes" if peer["sends"] else "no",
                    f"{view['src_view']}->{view['dst_view']}",
                    view["owner"],
                    "+".join(view["roles"]),
                    view["mapper"],
                    _heads(view),
                    _layers(view["layers"]),
                    str(view["bytes_per_block"]),
                    str(view["descriptors_per_block"]),
                )
            )
    return rows


def plan_text(plan: dict[str, Any]) -> str:
    """A fixed-width table with a header naming the pair, the generations and the bounce verdict."""
    sender, receiver = plan["sender"], plan["receiver"]
    generations = ", ".join(f"{rank}:{gen}" for rank, gen in sender["generations"].items())
    lines = [
        f"plan {plan['deployment']}: {sender['instance']} (dp group {sender['dp_rank']}) -> "
        f"{receiver['instance']} rank {receiver['rank']} (generation {receiver['generation']})",
        f"sender generations {{{generations}}}  fingerprint {plan['fingerprint']}",
        f"expected writers {plan['expected_writers']}  fan-in bounce safe {plan['fanin_bounce_safe']}  "
        f"bytes/block {plan['bytes_per_block']}  fragments/block {plan['fragments_per_block']}",
        "",
    ]
    lines += _table(COLUMNS, plan_rows(plan))
    lines += window_lines(plan)
    if "state_bytes" in plan:
        lines += [
            "",
            f"recurrent state, once per request slot: {plan['state_bytes']} bytes/request, "
            f"{plan['state_fragments']} fragments",
            *_table(STATE_COLUMNS, state_rows(plan)),
        ]
    lines += [f"warning: {w}" for w in plan.get("warnings", [])]
    return "\n".join(lines) + "\n"


def _table(columns: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    rows = [columns, *body]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for index, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.rjust(w) if cell.isdigit() else cell.ljust(w)
                for cell, w in zip(row, widths, strict=True)
            ).rstrip()
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def window_lines(plan: dict[str, Any]) -> list[str]:
    """One line per windowed view pair: the window it moves and the first block that is sent."""
    windows = {
        (v["src_view"], v["dst_view"]): v["window"]
        for p in plan["peers"]
        for v in p["views"]
        if "window" in v
    }
    return [
        f"window {src}->{dst}: last {w['tokens']} tokens (sender {_tokens(w['sender'])}, "
        f"receiver {_tokens(w['receiver'])}); request blocks from "
        f"floor((prompt_tokens + 1 - {w['tokens']}) / {w['tokens_per_block']}) are sent"
        for (src, dst), w in sorted(windows.items())
    ]


def _tokens(window: int | None) -> str:
    return "full" if window is None else str(window)


def state_rows(plan: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for peer in plan["peers"]:
        for state in peer.get("states", []):
            (s_tp, s_rank), (r_tp, r_rank) = state["mamba_tp"]["src"], state["mamba_tp"]["dst"]
            rows.append(
                (
                    str(peer["rank"]),
                    f"{state['src_view']}->{state['dst_view']}",
                    state["owner"],
                    "+".join(state["roles"]),
                    state["mapper"],
                    f"{s_rank}/{s_tp}->{r_rank}/{r_tp}",
                    _shard(state),
                    _layers(state["layers"]),
                    str(state["bytes"]),
                    str(state["descriptors"]),
                )
            )
    return rows


def _shard(state: dict[str, Any]) -> str:
    shard = state["shard"]
    if shard["unit"] == "whole":
        return "all"
    lo, hi = shard["dst"]
    unit = "heads" if shard["unit"] == "head" else f"parts of {shard['total']}"
    return f"{unit} {lo}" if hi - lo == 1 else f"{unit} {lo}-{hi - 1}"


def _bands(
    plan: dict[str, Any], dst_view: int
) -> tuple[list[int], list[tuple[list[int], dict[int, int]]]]:
    """Receiver heads of one view, and runs of layers whose head -> writer mapping is the same."""
    writer: dict[int, dict[int, int]] = {}  # layer -> head -> sender rank
    heads: set[int] = set()
    for peer in plan["peers"]:
        for view in peer["views"]:
            if view["dst_view"] != dst_view:
                continue
            lo, hi = view["heads"]["dst"] if view["mapper"] != "replicated" else (0, 1)
            heads.update(range(lo, hi))
            for layer in view["layers"]:
                writer.setdefault(layer, {}).update(dict.fromkeys(range(lo, hi), peer["rank"]))
    bands: list[tuple[list[int], dict[int, int]]] = []
    for layer in sorted(writer):
        if bands and bands[-1][1] == writer[layer] and bands[-1][0][-1] == layer - 1:
            bands[-1][0].append(layer)
        else:
            bands.append(([layer], writer[layer]))
    return sorted(heads), bands


def plan_svg(plan: dict[str, Any]) -> str:
    """One grid per receiver view: columns are the receiver's heads, rows are runs of layers, and
    each cell is coloured and labelled with the sender rank that writes it."""
    views = sorted({v["dst_view"]: v for p in plan["peers"] for v in p["views"]}.items())
    cell, label_width, y = 44, 120, 56
    parts: list[str] = []
    title_lengths = [0]
    grid = label_width + cell * max([1, *(len(_bands(plan, vid)[0]) for vid, _ in views)]) + 20
    for view_id, sample in views:
        heads, bands = _bands(plan, view_id)
        title = (
            f"view {view_id} ({sample['owner']}, {'+'.join(sample['roles'])}, {sample['mapper']})"
        ) + (f" window {sample['window']['tokens']}" if "window" in sample else "")
        title_lengths.append(len(title))
        parts.append(f'<text x="10" y="{y}" font-weight="bold">{escape(title)}</text>')
        y += 8
        for column, head in enumerate(heads):
            name = "all" if sample["mapper"] == "replicated" else f"h{head}"
            parts.append(
                f'<text x="{label_width + column * cell + cell / 2}" y="{y + 12}" text-anchor="middle" font-size="11">{name}</text>'
            )
        y += 18
        for layers, mapping in bands:
            parts.append(
                f'<text x="10" y="{y + cell / 2 + 4}" font-size="12">layers {_layers(layers)}</text>'
            )
            for column, head in enumerate(heads):
                rank = mapping.get(head)
                x = label_width + column * cell
                fill = PALETTE[rank % len(PALETTE)] if rank is not None else "#ffffff"
                parts.append(
                    f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}" stroke="#333"><title>head {head}, layers {_layers(layers)}: sender rank {rank}</title></rect>'
                )
                label = f"r{rank}" if rank is not None else "-"
                parts.append(
                    f'<text x="{x + cell / 2 - 1}" y="{y + cell / 2 + 4}" text-anchor="middle" font-size="12" fill="#000">{label}</text>'
                )
            y += cell
        y += 24
    y, state_columns = _state_grids(plan, parts, title_lengths, y, cell, label_width)
    grid = max(grid, label_width + cell * state_columns + 20)
    header = (
        f"{plan['sender']['instance']} -> {plan['receiver']['instance']} rank {plan['receiver']['rank']}: "
        f"{plan['expected_writers']} writers, bounce safe {plan['fanin_bounce_safe']}"
    )
    width = max(grid, 20 + 9 * max(len(header), *title_lengths))  # ~9 px per monospace character
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="monospace">'
        f'<rect width="100%" height="100%" fill="#fafafa"/>'
        f'<text x="10" y="24" font-size="14">{escape(header)}</text>{"".join(parts)}</svg>\n'
    )


def _state_cells(
    plan: dict[str, Any], dst_view: int
) -> tuple[list[int], list[tuple[list[int], dict[int, int]]]]:
    """Receiver shard positions of one state view, and layer runs with one position -> writer map."""
    writer: dict[int, dict[int, int]] = {}
    units: set[int] = set()
    for peer in plan["peers"]:
        for state in peer.get("states", []):
            if state["dst_view"] == dst_view:
                lo, hi = state["shard"]["dst"]
                units.update(range(lo, hi))
                for layer in state["layers"]:
                    writer.setdefault(layer, {}).update(dict.fromkeys(range(lo, hi), peer["rank"]))
    bands: list[tuple[list[int], dict[int, int]]] = []
    for layer in sorted(writer):
        if bands and bands[-1][1] == writer[layer] and bands[-1][0][-1] == layer - 1:
            bands[-1][0].append(layer)
        else:
            bands.append(([layer], writer[layer]))
    return sorted(units), bands


def _state_grids(
    plan: dict[str, Any], parts: list[str], titles: list[int], y: int, cell: int, left: int
) -> tuple[int, int]:
    """One grid per receiver state view, below the block views: columns are the receiver's shard
    positions (SSM heads, conv parts), rows are layer runs, cells name the writing sender rank."""
    states = sorted({s["dst_view"]: s for p in plan["peers"] for s in p.get("states", [])}.items())
    columns = 0
    for view_id, sample in states:
        units, bands = _state_cells(plan, view_id)
        columns = max(columns, len(units))
        title = f"state view {view_id} ({sample['owner']}, {'+'.join(sample['roles'])}, {sample['mapper']}, per request)"
        titles.append(len(title))
        parts.append(f'<text x="10" y="{y}" font-weight="bold">{escape(title)}</text>')
        prefix = {"head": "h", "part": "p"}.get(sample["shard"]["unit"])
        parts += [
            f'<text x="{left + column * cell + cell / 2}" y="{y + 20}" text-anchor="middle" font-size="11">{f"{prefix}{unit}" if prefix else "all"}</text>'
            for column, unit in enumerate(units)
        ]
        y += 26
        for layers, mapping in bands:
            parts.append(
                f'<text x="10" y="{y + cell / 2 + 4}" font-size="12">layers {_layers(layers)}</text>'
            )
            for column, unit in enumerate(units):
                rank, x = mapping.get(unit), left + column * cell
                fill = PALETTE[rank % len(PALETTE)] if rank is not None else "#ffffff"
                parts.append(
                    f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}" stroke="#333"><title>state {sample["shard"]["unit"]} {unit}, layers {_layers(layers)}: sender rank {rank}</title></rect>'
                    f'<text x="{x + cell / 2 - 1}" y="{y + cell / 2 + 4}" text-anchor="middle" font-size="12">{"-" if rank is None else f"r{rank}"}</text>'
                )
            y += cell
        y += 24
    return y, columns
