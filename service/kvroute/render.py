"""Plans for people as a text table: one row per (sender rank, view pair), under a header.

Works on the typed plan (``geometry.Plan``: built here, or a document read back by
``Plan.from_json`` where it arrived), so the service, the CLI and a worker holding a fetched plan
render the same thing. Nothing here knows how plans are built. A new plan member
shows up as one more header line in ``plan_text`` or one more column (``COLUMNS`` and a cell in
``plan_rows``). View pairs planned by period, windowed ones and ones without whole token rows add a
line each; recurrent state adds a second table (one row
per sender rank and state view pair, per request slot). The pictures (SVG) live in
``kvroute.pictures``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from kvroute.geometry import Plan, Spread, StateTransfer, ViewTransfer, Window

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


def _heads(view: ViewTransfer) -> str:
    if view.mapper == "replicated":
        return "all"
    lo, hi = view.dst_heads
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _layers(layers: Sequence[int]) -> str:
    if not layers:
        return "-"
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}" if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def plan_rows(plan: Plan) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for peer in plan.peers:
        if not peer.views:
            rows.append((str(peer.rank), "no", "-", "-", "-", "-", "-", "-", "0", "0"))
        for view in peer.views:
            rows.append(
                (
                    str(peer.rank),
                    "yes" if peer.sends else "no",
                    f"{view.src_view}->{view.dst_view}",
                    view.owner,
                    "+".join(view.roles),
                    view.mapper,
                    _heads(view),
                    _layers(view.layers),
                    str(view.bytes_per_block),
                    str(view.descriptors_per_block),
                )
            )
    return rows


def plan_text(plan: Plan) -> str:
    """A fixed-width table with a header naming the pair, the generations and the bounce verdict."""
    generations = ", ".join(
        f"{rank}:{plan.sender_generations.get(rank)}" for rank in plan.sender_ranks
    )
    lines = [
        f"plan {plan.deployment}: {plan.sender_instance} (dp group {plan.sender_dp_rank}) -> "
        f"{plan.receiver_instance} rank {plan.receiver_rank} "
        f"(generation {plan.receiver_generation})",
        f"sender generations {{{generations}}}  fingerprint {plan.fingerprint}",
        f"expected writers {plan.expected_writers}  fan-in bounce safe {plan.fanin_bounce_safe}  "
        f"bytes/block {plan.bytes_per_block}  fragments/block {plan.fragments_per_block}",
        "",
    ]
    lines += _table(COLUMNS, plan_rows(plan))
    lines += period_lines(plan)
    lines += window_lines(plan)
    lines += whole_block_lines(plan)
    if plan.has_state:
        lines += [
            "",
            f"recurrent state, once per request slot: {plan.state_bytes} bytes/request, "
            f"{plan.state_fragments} fragments",
            *_table(STATE_COLUMNS, state_rows(plan)),
        ]
    lines += [f"warning: {w}" for w in plan.warnings]
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


def is_cp(view: ViewTransfer) -> bool:
    """The view pair has context parallelism on a side: its blocks hold a rank's own tokens."""
    return view.period_map.context_parallel


def _spread(view: ViewTransfer, side: str) -> Spread | None:
    period = view.period_map
    spread = period.src_spread if side == "src" else period.dst_spread
    return None if spread.trivial else spread


def held_runs(view: ViewTransfer, side: str) -> list[tuple[int, int]]:
    """The runs [first, end) of one period's prompt tokens a side's rank holds."""
    period, cp = view.period_map.period_tokens, _spread(view, side)
    if cp is None:
        return [(0, period)]
    if cp.chunked:  # prefill chunks of one prompt: the rank's chunks, in token order
        return [(first, end) for first, end, _ in cp.runs()]
    size, rank, n = cp.size, cp.rank, cp.interleave
    return [(a, a + n) for a in range(rank * n, period, size * n)]


def placement(view: ViewTransfer, side: str, limit: int = 6) -> str:
    """Which prompt tokens of a period a side's rank holds, in words."""
    cp = _spread(view, side)
    if cp is None:
        return "every token"
    runs = held_runs(view, side)
    shown = " ".join(f"[{a},{b})" for a, b in runs[:limit]) + (" ..." if len(runs) > limit else "")
    deal = (
        f"{cp.layout} chunks of a {cp.prompt}-token prompt"
        if cp.chunked
        else f"interleave {cp.interleave}"
    )
    return f"CP rank {cp.rank} of {cp.size} ({deal}): tokens {shown}"


def period_pieces(view: ViewTransfer) -> list[tuple[int, int, int, int]]:
    """(sender block, receiver block, first token, end token) of each cut of a view pair's period.

    With context parallelism the pieces are the runs of tokens both ranks hold (from the
    fragments; blocks are each rank's local blocks)."""
    period = view.period_map
    if is_cp(view):
        cuts = sorted({(f[5], f[5] + f[6], f[0], f[2]) for f in period.spans})
        pieces: list[tuple[int, int, int, int]] = []
        for first, end, src, dst in cuts:
            if pieces and pieces[-1][:2] == (src, dst) and pieces[-1][3] >= first:
                pieces[-1] = (src, dst, pieces[-1][2], max(end, pieces[-1][3]))
            else:
                pieces.append((src, dst, first, end))
        return pieces
    tokens = period.period_tokens
    src = tokens // period.src_blocks_per_period
    dst = tokens // period.dst_blocks_per_period
    bounds = sorted({*range(0, tokens, src), *range(0, tokens, dst), tokens})
    return [(a // src, a // dst, a, b) for a, b in pairwise(bounds)]


def period_lines(plan: Plan, limit: int = 12) -> list[str]:
    """One line per receiver view planned by period: which sender block fills which receiver block."""
    lines = []
    views = {v.dst_view: v for p in plan.peers for v in p.views if v.periodic and not is_cp(v)}
    for view_id, view in sorted(views.items()):
        period = view.period_map.period_tokens
        src, dst = view.period_map.src_blocks_per_period, view.period_map.dst_blocks_per_period
        pieces = [f"sb{s}->rb{d} [{a},{b})" for s, d, a, b in period_pieces(view)]
        shown = "  ".join(pieces[:limit]) + ("  ..." if len(pieces) > limit else "")
        lines.append(
            f"period view {view_id}: {period} tokens = {src} sender blocks of {period // src} -> "
            f"{dst} receiver blocks of {period // dst}; {shown}"
        )
    return lines + cp_lines(plan, limit)


def cp_lines(plan: Plan, limit: int = 12) -> list[str]:
    """One line per context-parallel view pair a sender rank writes: the token split of its period
    (which prompt tokens each side's rank holds) and the pieces it moves."""
    lines = []
    for peer in plan.peers:
        for view in peer.views:
            if not view.periodic or not is_cp(view) or not view.period_map.spans:
                continue
            pieces = [f"sb{s}->rb{d} [{a},{b})" for s, d, a, b in period_pieces(view)]
            shown = "  ".join(pieces[:limit]) + ("  ..." if len(pieces) > limit else "")
            lines.append(
                f"period view {view.dst_view} from rank {peer.rank}: "
                f"{view.period_map.period_tokens} tokens; sender {placement(view, 'src')}; "
                f"receiver {placement(view, 'dst')}; {shown}"
            )
    return lines


def whole_block_lines(plan: Plan) -> list[str]:
    """One line per view pair whose bytes are not whole token rows (``token_rows: false``)."""
    pairs = {(v.src_view, v.dst_view) for p in plan.peers for v in p.views if not v.token_rows}
    return [
        f"whole blocks {src}->{dst}: bytes per layer are not whole token rows; no token range "
        "is cut from its blocks (block form only)"
        for src, dst in sorted(pairs)
    ]


def window_lines(plan: Plan) -> list[str]:
    """One line per windowed view pair: the window it moves and the first block that is sent."""
    windows = {(v.src_view, v.dst_view): v.window for p in plan.peers for v in p.views if v.window}
    return [
        f"window {src}->{dst}: last {w.tokens} tokens (sender {_tokens(w.sender)}, "
        f"receiver {_tokens(w.receiver)}); {_window_start(w)}"
        for (src, dst), w in sorted(windows.items())
    ]


def _window_start(window: Window) -> str:
    """Where a windowed pair starts moving, in the prompt length's terms (``geometry.window``)."""
    first = f"prompt_tokens + 1 - {window.tokens}"
    src, dst = window.src_tokens_per_block, window.dst_tokens_per_block
    if src == dst:
        return f"request blocks from floor(({first}) / {src}) are sent"
    return (
        f"tokens from the later block start at or before {first} ({src}-token sender blocks, "
        f"{dst}-token receiver blocks) are sent"
    )


def _tokens(window: int | None) -> str:
    return "full" if window is None else str(window)


def state_rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row per (sender rank, state view pair): what it writes of the request's state slot."""
    rows: list[tuple[str, ...]] = []
    for peer in plan.peers:
        for state in peer.states:
            (s_tp, s_rank), (r_tp, r_rank) = state.mamba_tp
            rows.append(
                (
                    str(peer.rank),
                    f"{state.src_view}->{state.dst_view}",
                    state.owner,
                    "+".join(state.roles),
                    state.mapper,
                    f"{s_rank}/{s_tp}->{r_rank}/{r_tp}",
                    state_shard(state),
                    _layers(state.layers),
                    str(state.nbytes),
                    str(len(state.fragments)),
                )
            )
    return rows


def state_shard(state: StateTransfer) -> str:
    """What part of every section a state transfer writes: SSM heads, parts of lcm(TPs), all."""
    if state.shard_unit == "whole":
        return "all"
    lo, hi = state.dst_shard
    unit = "heads" if state.shard_unit == "head" else f"parts of {state.shard_total}"
    return f"{unit} {lo}" if hi - lo == 1 else f"{unit} {lo}-{hi - 1}"
