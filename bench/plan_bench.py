"""Plan-building benchmark: how long kvroute takes to plan realistic deployments.

For each deployment it prints the median time to build one receiver rank's plan and all of the
receiver instance's plans, the fragments per (receiver) block and per token, and, as a ratio, the
plan build time against two baselines measured in the same run on the same plans: validating the
pair (check_peers, which every plan request repeats) and serialising the plan to JSON (which every
HTTP answer pays anyway). Deployments pairing different tokens per block (16 -> 64, 64 -> 16) have
plans that state a period of 64 tokens instead of block fragments; the hybrid rows add per-request
state fragments, and the last one windowed attention between block sizes.

    python bench/plan_bench.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from rich.console import Console
from rich.table import Table

from kvroute.geometry import (
    Kind,
    Owner,
    Plan,
    Pool,
    RankRegistration,
    View,
    build_plan,
    check_peers,
)
from kvroute.geometry.registration.builder import LayerSpec, build_views
from kvroute.geometry.registration.rendering import render_pool, render_view


@dataclass(frozen=True)
class Model:
    layers: int
    kv_heads: int
    draft_heads: int
    head_dim: int = 128
    tokens: int = 32
    bytes_per_element: int = 2
    kind: Kind = Kind.HND
    indexer: bool = True  # a replicated index-key view per layer

    def head_bytes(self) -> int:
        return self.tokens * self.head_dim * self.bytes_per_element


def _specs(model: Model, tp: int, stage: range, draft: bool) -> list[LayerSpec]:
    heads = max(1, model.kv_heads // tp)  # tp here is the attention-DP group size
    draft_heads = max(1, model.draft_heads // tp)
    kv_bytes = 2 * heads * model.head_bytes()
    index_bytes = model.tokens * 128
    specs, offset = [], 0
    for layer in stage:
        specs.append(
            LayerSpec(
                layer,
                0,
                offset,
                kv_bytes,
                model.kind,
                num_kv_heads=heads,
                total_kv_heads=model.kv_heads,
            )
        )
        offset += kv_bytes
        if model.indexer:
            specs.append(
                LayerSpec(
                    layer,
                    0,
                    offset,
                    index_bytes,
                    Kind.REPLICATED,
                    roles=frozenset({"index_key"}),
                    buffers_per_layer=1,
                )
            )
            offset += index_bytes
    if draft:
        size = 2 * draft_heads * model.head_bytes()
        specs.append(
            LayerSpec(
                0,
                0,
                offset,
                size,
                model.kind,
                Owner.DRAFT,
                num_kv_heads=draft_heads,
                total_kv_heads=model.draft_heads,
            )
        )
    return specs


@dataclass(frozen=True)
class Hybrid:
    """Nemotron-H-like: Mamba2 layers (SSM + [x | B | C] conv state in a per-request pool) and a few
    attention layers (8 KV heads) in a KV pool; the other layers are MLPs without cache."""

    layers: int = 52
    attention: tuple[int, ...] = (7, 18, 29, 40)
    kv_heads: int = 8
    draft_heads: int = 8
    ssm_heads: int = 128
    ssm_head_bytes: int = 64 * 128 * 2  # head_dim x d_state x bf16
    conv_sections: tuple[int, ...] = (8192 * 3 * 2, 1024 * 3 * 2, 1024 * 3 * 2)  # x, B, C
    head_dim: int = 128
    tokens: int = 32
    window: int | None = None  # a sliding window on the attention layers (gpt-oss-like)

    def head_bytes(self) -> int:
        return self.tokens * self.head_dim * 2

    def mamba(self, layer: int) -> bool:
        return layer % 2 == 0 and layer not in self.attention


def _hybrid_specs(model: Hybrid, tp: int, stage: range, draft: bool) -> list[LayerSpec]:
    heads = max(1, model.kv_heads // tp)
    kv_bytes, offsets = 2 * heads * model.head_bytes(), [0, 0]
    specs = []
    sections = tuple(size // tp for size in model.conv_sections)
    for layer in stage:
        if layer in model.attention:
            specs.append(LayerSpec(layer, 0, offsets[0], kv_bytes, num_kv_heads=heads,
                                   total_kv_heads=model.kv_heads,
                                   sliding_window=model.window))  # fmt: skip
            offsets[0] += kv_bytes
        elif model.mamba(layer):
            ssm = model.ssm_heads // tp * model.ssm_head_bytes
            specs.append(LayerSpec(layer, 1, offsets[1], ssm, Kind.SSM, roles=frozenset({"ssm"}),
                                   buffers_per_layer=1, ssm_bytes_per_head=model.ssm_head_bytes))  # fmt: skip
            specs.append(LayerSpec(layer, 1, offsets[1] + ssm, sum(sections), Kind.CONV,
                                   roles=frozenset({"conv"}), buffers_per_layer=1,
                                   conv_sections=sections))  # fmt: skip
            offsets[1] += ssm + sum(sections)
    if draft:
        specs.append(LayerSpec(0, 0, offsets[0], kv_bytes, owner=Owner.DRAFT, num_kv_heads=heads,
                               total_kv_heads=model.draft_heads))  # fmt: skip
    return specs


def instance(
    model: Model | Hybrid, role: str, name: str, tp: int, pp: int, dp: int = 1
) -> list[RankRegistration]:
    split = [model.layers // pp + (1 if p < model.layers % pp else 0) for p in range(pp)]
    ranks = []
    for rank in range(tp * pp):
        pp_rank, tp_rank = divmod(rank, tp)
        start = sum(split[:pp_rank])
        stage, draft = range(start, start + split[pp_rank]), pp_rank == pp - 1
        views = build_views(
            _hybrid_specs(model, tp, stage, draft)
            if isinstance(model, Hybrid)
            else _specs(model, tp, stage, draft)
        )
        doc = {
            "role": role,
            "tp_size": tp,
            "tp_rank": tp_rank,
            "pp_size": pp,
            "pp_rank": pp_rank,
            "layers_per_stage": split,
            "num_draft_layers": 1,
            "tokens_per_block": model.tokens,
            "attention": {
                "num_kv_heads": max(1, model.kv_heads // tp),
                "head_dim": model.head_dim,
                "dtype": "bfloat16",
            },
            "pools": [
                render_pool_doc(
                    pool, max(s.offset + v.bytes_per_layer for v in group for s in v.layers)
                )
                for pool, group in _by_pool(views).items()
            ],
            "views": [render_view(v) for v in views],
        }
        ranks.append(RankRegistration.from_json(doc, deployment="bench", instance=name, rank=rank))
    return ranks


def interleaved_fleet(
    model: Model | Hybrid,
    instances: int,
    context_layout: tuple[int, int],
    generation_layout: tuple[int, int],
) -> list[tuple[str, RankRegistration]]:
    """Every rank, instances interleaved (ctx0, gen0, ctx1, ...) as a fleet comes up."""
    context = instance(model, "context", "ctx", *context_layout)
    generation = instance(model, "generation", "gen", *generation_layout)
    ranks = []
    for index in range(instances):
        ranks += [(f"ctx{index}", reg) for reg in context]
        ranks += [(f"gen{index}", reg) for reg in generation]
    return ranks


def _by_pool(views: Sequence[View]) -> dict[int, list[View]]:
    pools: dict[int, list[View]] = {}
    for view in views:
        pools.setdefault(view.pool_id, []).append(view)
    return pools


def render_pool_doc(pool_id: int, slot: int) -> dict:
    return render_pool(Pool(pool_id, slot, slot, 4096))


def timings(action: Callable[[], object], repeat: int) -> list[float]:
    """Wall seconds of ``repeat`` runs of ``action``."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return samples


def median_seconds(action: Callable[[], object], repeat: int) -> float:
    return statistics.median(timings(action, repeat))


CASES: list[
    tuple[str, Model, tuple[int, ...], tuple[int, ...]]
    | tuple[str, Model, tuple[int, ...], tuple[int, ...], Model]
] = [
    ("80L HND ctx TP8xPP2 -> gen TP4 (target+draft+indexer)", Model(80, 8, 4), (8, 2), (4, 1)),
    (
        "80L HND 16 -> 64 tokens/block, ctx TP8xPP2 -> gen TP4",
        Model(80, 8, 4, tokens=16),
        (8, 2),
        (4, 1),
        Model(80, 8, 4, tokens=64),
    ),
    (
        "80L HND 64 -> 16 tokens/block, ctx TP4 -> gen TP8",
        Model(80, 8, 4, tokens=64),
        (4, 1),
        (8, 1),
        Model(80, 8, 4, tokens=16),
    ),
    (
        "32L NHD 16 -> 64 tokens/block, heads halved ctx TP2 -> gen TP4",
        Model(32, 8, 4, tokens=16, kind=Kind.NHD, indexer=False),
        (2, 1),
        (4, 1),
        Model(32, 8, 4, tokens=64, kind=Kind.NHD, indexer=False),
    ),
    (
        "80L NHD head mismatch ctx TP8xPP2 -> gen TP2",
        Model(80, 8, 4, kind=Kind.NHD, indexer=False),
        (8, 2),
        (2, 1),
    ),
    ("48L HND ctx TP3 -> gen TP2, 6 heads (non-integer ratio)", Model(48, 6, 6), (3, 1), (2, 1)),
    (
        "61L MLA-like ctx TP8 -> gen TP8 attention-DP8",
        Model(61, 1, 1, head_dim=576, indexer=True),
        (8, 1, 1),
        (8, 1, 8),
    ),
    (
        "52L Nemotron-H-like hybrid ctx TP4 -> gen TP2 (Mamba2 state + 4 attention)",
        Hybrid(),
        (4, 1),
        (2, 1),
    ),
    (
        "52L hybrid, 4096-token windows, 32 -> 64 tokens/block, ctx TP4 -> gen TP2",
        Hybrid(window=4096),
        (4, 1),
        (2, 1),
        Hybrid(window=4096, tokens=64),
    ),
]


def _plan_all(ctx: list[RankRegistration], gen: list[RankRegistration]) -> None:
    for receiver in gen:
        build_plan(ctx, receiver)


def _serialise(plan: Plan) -> str:
    return json.dumps(plan.to_json())


def fragments_per_token(plan: Plan) -> float:
    """Fragments a receiver rank's plan needs per moved token, over its views."""
    total = 0.0
    for peer in plan.peers:
        for view in peer.views:
            if view.periodic:
                total += len(view.period_map.spans) / view.period_map.period_tokens
            elif view.axis is not None:
                total += len(view.fragments) / view.axis.dst_tokens
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    table = Table(title="kvroute plan build (median)", expand=True)
    for column in (
        "deployment",
        "one plan ms",
        "all plans ms",
        "fragments/block",
        "fragments/token",
        "vs check_peers",
        "vs json.dumps",
    ):
        table.add_column(column, justify="right" if column != "deployment" else "left")
    for name, model, ctx_layout, gen_layout, *receiving in CASES:
        ctx = instance(model, "context", "ctx", *ctx_layout)
        gen = instance(receiving[0] if receiving else model, "generation", "gen", *gen_layout)
        receiver = gen[0]
        plan = build_plan(ctx, receiver)
        one = median_seconds(partial(build_plan, ctx, receiver), args.repeat)
        every = median_seconds(partial(_plan_all, ctx, gen), max(3, args.repeat // 5))
        checks = median_seconds(partial(check_peers, receiver, ctx), args.repeat)
        dumps = median_seconds(partial(_serialise, plan), args.repeat)
        table.add_row(
            name,
            f"{one * 1e3:.2f}",
            f"{every * 1e3:.1f}",
            f"{plan.fragments_per_block}"
            + (f" + {plan.state_fragments}/request" if plan.has_state else ""),
            f"{fragments_per_token(plan):.1f}",
            f"{one / checks:.2f}x",
            f"{one / dumps:.2f}x",
        )
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
