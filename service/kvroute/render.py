"""Plans for people: a text table and an SVG picture of which sender rank writes which heads.

Both work on the plan JSON document (API.md shape), so the service, the CLI and a worker holding a
fetched plan render the same thing. Nothing here knows how plans are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from itertools import pairwise
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
STRIP_WIDTH = 384  # pixels for one period of tokens in the SVG
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
    rows = [COLUMNS, *plan_rows(plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for index, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.rjust(w) if cell.isdigit() else cell.ljust(w)
                for cell, w in zip(row, widths, strict=True)
            ).rstrip()
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += period_lines(plan)
    lines += [f"warning: {w}" for w in plan.get("warnings", [])]
    return "\n".join(lines) + "\n"


def period_pieces(view: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """(sender block, receiver block, first token, end token) of each cut of a view pair's period."""
    period = view["period_tokens"]
    src = period // view["src_blocks_per_period"]
    dst = period // view["dst_blocks_per_period"]
    cuts = sorted({*range(0, period, src), *range(0, period, dst), period})
    return [(a // src, a // dst, a, b) for a, b in pairwise(cuts)]


def period_lines(plan: dict[str, Any], limit: int = 12) -> list[str]:
    """One line per receiver view planned by period: which sender block fills which receiver block."""
    lines = []
    views = {v["dst_view"]: v for p in plan["peers"] for v in p["views"] if "period_tokens" in v}
    for view_id, view in sorted(views.items()):
        period = view["period_tokens"]
        src, dst = view["src_blocks_per_period"], view["dst_blocks_per_period"]
        pieces = [f"sb{s}->rb{d} [{a},{b})" for s, d, a, b in period_pieces(view)]
        shown = "  ".join(pieces[:limit]) + ("  ..." if len(pieces) > limit else "")
        lines.append(
            f"period view {view_id}: {period} tokens = {src} sender blocks of {period // src} -> "
            f"{dst} receiver blocks of {period // dst}; {shown}"
        )
    return lines


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
        )
        title_lengths.append(len(title))
        parts.append(f'<text x="10" y="{y}" font-weight="bold">{escape(title)}</text>')
        y += 8
        if "period_tokens" in sample:
            y = _period_strip(sample, y, STRIP_WIDTH, parts)
            grid = max(grid, label_width + STRIP_WIDTH + 20)
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


def _period_strip(view: dict[str, Any], y: int, width: int, parts: list[str]) -> int:
    """Two bars over one period of tokens, sender blocks above receiver blocks, cut where either
    side's block ends; each cut is titled with the blocks and tokens it moves. Returns the next y."""
    period, x0, row = view["period_tokens"], 120, 18
    scale = width / period
    for line, (label, blocks) in enumerate(
        (("sender", view["src_blocks_per_period"]), ("receiver", view["dst_blocks_per_period"]))
    ):
        top = y + 4 + line * row
        parts.append(f'<text x="10" y="{top + 13}" font-size="11">{label} blocks</text>')
        size = period // blocks
        for block in range(blocks):
            x, w = x0 + block * size * scale, size * scale
            parts.append(
                f'<rect x="{x:.1f}" y="{top}" width="{w - 1:.1f}" height="{row - 2}" '
                f'fill="{PALETTE[block % len(PALETTE)]}" fill-opacity="0.35" stroke="#333"/>'
            )
            parts.append(
                f'<text x="{x + 3:.1f}" y="{top + 13}" font-size="11">{label[0]}b{block}</text>'
            )
    for src, dst, a, b in period_pieces(view):
        parts.append(
            f'<line x1="{x0 + a * scale:.1f}" y1="{y + 4}" x2="{x0 + a * scale:.1f}" '
            f'y2="{y + 4 + 2 * row}" stroke="#000" stroke-dasharray="2,2">'
            f"<title>tokens [{a}, {b}): sender block {src} -> receiver block {dst}</title></line>"
        )
    note = f"{period} tokens per period, {view['descriptors_per_period']} fragments"
    parts.append(f'<text x="{x0}" y="{y + 2 * row + 18}" font-size="11">{escape(note)}</text>')
    return y + 2 * row + 28
