"""Transfer-engine throughput against the physical limit and a naive per-fragment loop.

For each layout (HND head slicing, NHD head mismatch, a fragmented block list) and each device
(CPU, and CUDA when present) it times every copy strategy of ``kvroute.transfer.CopyEngine`` on a
64-block job and prints GB/s, the ratio to a raw contiguous copy of the same number of bytes on
the same device, and the speed-up over one ``copy_`` per fragment. Every strategy's result is
checked byte for byte against the naive loop's.

Then blocks of different sizes (16 -> 64 and 64 -> 16 tokens per block, planned by
``kvroute.geometry.build_plan``): a ``--tokens`` token range, block aligned and cut mid-block at
both ends, against the same contiguous copy and a naive loop over ``geometry.range_copies``. Last, a
hybrid request (``plan_bench.Hybrid``: 52 layers, 24 Mamba2 with 128 SSM heads of 64 x 128 bf16 and
conv [x | B | C], 4 attention layers) from context TP4 to generation TP2 rank 0: its KV blocks and
its state slot once, with equal blocks (block pairs) and 32 -> 64 tokens per block (a range cut
mid-block at both ends).

    .venv/bin/python bench/transfer_bench.py [--blocks 64] [--tokens 512] [--device cpu|cuda|all]

Model: 32 layers x 2 buffers (K, V) x 8 KV heads x 32 tokens x 128 dims bf16 on the sender
(4 MiB per block); the receiver holds half the heads (2 MiB per block). The re-blocking rows keep
every head on both sides (128 KiB per token).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import plan_bench  # bench/ is the script's directory, so its sibling imports as a module
from kvroute.geometry import (
    Pool,
    RankRegistration,
    TokenRange,
    TokenWindow,
    build_plan,
    range_copies,
)
from kvroute.transfer import (
    CopyEngine,
    CopyPlan,
    LocalBackend,
    PeerCopy,
    PoolMemory,
    PoolMemoryCache,
    Strategy,
    TransferJob,
    TransferLeg,
    ViewCopy,
)
from kvroute.transfer.fragments import fragment_array
from tables import figures_table

LAYERS, BUFFERS, HEADS, TOKENS, HEAD_BYTES = 32, 2, 8, 32, 128 * 2
RECEIVER_HEADS = HEADS // 2
HND_TARGET_RATIO = 0.7
NHD_TARGET_SPEEDUP = 10.0


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    contiguous_blocks: bool


CASES = (
    Case("HND, heads halved", "hnd", contiguous_blocks=True),
    Case("NHD, heads halved", "nhd", contiguous_blocks=True),
    Case("HND, fragmented blocks", "hnd", contiguous_blocks=False),
)


def fragments(kind: str) -> list[list[int]]:
    """Receiver = TP2 rank 1: heads 4..7 of every layer buffer."""
    src_buffer, dst_buffer = HEADS * TOKENS * HEAD_BYTES, RECEIVER_HEADS * TOKENS * HEAD_BYTES
    out = []
    for region in range(LAYERS * BUFFERS):
        src, dst = region * src_buffer, region * dst_buffer
        if kind == "hnd":
            span = RECEIVER_HEADS * TOKENS * HEAD_BYTES
            out.append([src + RECEIVER_HEADS * TOKENS * HEAD_BYTES, dst, span])
            continue
        for token in range(TOKENS):
            out.append(
                [
                    src + (token * HEADS + RECEIVER_HEADS) * HEAD_BYTES,
                    dst + token * RECEIVER_HEADS * HEAD_BYTES,
                    RECEIVER_HEADS * HEAD_BYTES,
                ]
            )
    return out


def timed(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` runs after one warm-up."""
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def naive_copy(job: TransferJob) -> None:
    """What a data plane without fusion does: one copy per fragment per block."""
    (leg,) = job.legs
    src, dst = leg.src_pools[(0, 0)], leg.dst_pools[0]
    frags = leg.plan.senders[0].views[0].fragments.tolist()
    for src_block, dst_block in zip(job.src_blocks.tolist(), job.dst_blocks.tolist(), strict=True):
        src_base, dst_base = src_block * src.pool.slot_stride, dst_block * dst.pool.slot_stride
        for src_offset, dst_offset, length in frags:
            d, s = dst_base + dst_offset, src_base + src_offset
            dst.tensor[d : d + length].copy_(src.tensor[s : s + length])


def _case_plan(case: Case) -> CopyPlan:
    """One view pair of pool 0 moving the case's fragments, in the data plane's own types."""
    view = ViewCopy(0, 0, 0, 0, case.kind, fragment_array(fragments(case.kind)))
    return CopyPlan.checked(case.kind, (PeerCopy(0, True, (view,)),))


def bench_device(device: torch.device, blocks: int, table: Table, verdicts: list[str]) -> None:
    src_slot = LAYERS * BUFFERS * HEADS * TOKENS * HEAD_BYTES
    dst_slot = src_slot * RECEIVER_HEADS // HEADS
    slots = blocks + blocks // 2
    backend = LocalBackend()
    backend.register(
        "src", torch.randint(0, 256, (slots * src_slot,), dtype=torch.uint8).to(device)
    )
    backend.register("dst", torch.zeros(slots * dst_slot, dtype=torch.uint8, device=device))
    cache = PoolMemoryCache([backend])
    src = cache.open_pool({"backend": "local", "name": "src"}, Pool(0, src_slot, src_slot, slots))
    dst = cache.open_pool({"backend": "local", "name": "dst"}, Pool(0, dst_slot, dst_slot, slots))
    rng = np.random.default_rng(0)
    engine = CopyEngine()
    repeats = 5
    for case in CASES:
        if case.contiguous_blocks:
            src_blocks, dst_blocks = np.arange(blocks), np.arange(blocks)
        else:
            src_blocks = rng.choice(slots, blocks, replace=False)
            dst_blocks = rng.choice(slots, blocks, replace=False)
        plan = _case_plan(case)
        job = TransferJob([TransferLeg(plan, {(0, 0): src}, {0: dst})], src_blocks, dst_blocks)
        nbytes = plan.bytes_per_block * blocks
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        flat_dst = torch.empty_like(flat_src)
        limit = timed(lambda d=flat_dst, s=flat_src: d.copy_(s), device, repeats)
        dst.tensor.zero_()
        naive = timed(lambda job=job: naive_copy(job), device, 1)
        reference = dst.tensor.clone()
        label = f"{case.name} [{device.type}]"
        per_block = f"{plan.fragments_per_block} x {nbytes // plan.fragments_per_block // blocks} B"
        table.add_row(
            label, "contiguous copy", per_block, f"{nbytes / limit / 1e9:.2f}", "1.00", ""
        )
        table.add_row(
            label, "naive loop", "", f"{nbytes / naive / 1e9:.2f}", f"{limit / naive:.2f}", "1.0x"
        )
        for strategy in Strategy:
            dst.tensor.zero_()
            seconds = timed(
                lambda job=job, s=strategy: engine.copy(job, strategy=s), device, repeats
            )
            if not torch.equal(dst.tensor, reference):
                raise SystemExit(f"{strategy} copied wrong bytes for {label}")
            ratio, speedup = limit / seconds, naive / seconds
            table.add_row(label, str(strategy), "", f"{nbytes / seconds / 1e9:.2f}",
                          f"{ratio:.2f}", f"{speedup:.1f}x")  # fmt: skip
            if device.type == "cpu" and strategy is Strategy.BLOCKWISE:
                verdicts.append(_verdict(case, label, ratio, speedup))
    cache.close()


def _verdict(case: Case, label: str, ratio: float, speedup: float) -> str:
    """The CPU blockwise target of a case: near memcpy for HND, far past the loop for NHD."""
    if case.kind == "hnd":
        ok = ratio >= HND_TARGET_RATIO
        return f"{label}: {ratio:.2f} of contiguous (target >= 0.7): " + ("met" if ok else "MISSED")
    ok = speedup >= NHD_TARGET_SPEEDUP
    return f"{label}: {speedup:.1f}x the naive loop (target >= 10x): " + ("met" if ok else "MISSED")


def rank_document(role: str, tokens: int, slots: int) -> RankRegistration:
    """One TP1 rank holding every head, HND, ``tokens`` tokens per block."""
    region = BUFFERS * HEADS * tokens * HEAD_BYTES
    doc = {
        "role": role, "tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "layers_per_stage": [LAYERS], "tokens_per_block": tokens,
        "attention": {"num_kv_heads": HEADS, "head_dim": HEAD_BYTES // 2, "dtype": "bfloat16"},
        "pools": [{"pool_id": 0, "slot_bytes": LAYERS * region, "num_slots": slots}],
        "views": [{
            "view_id": 0, "pool_id": 0, "kind": "hnd", "roles": ["key", "value"],
            "owner": "target", "num_kv_heads": HEADS, "buffers_per_layer": BUFFERS,
            "bytes_per_layer": region,
            "layers": [{"layer": layer, "offset": layer * region} for layer in range(LAYERS)],
        }],
    }  # fmt: skip
    name = "ctx" if role == "context" else "gen"
    return RankRegistration.from_json(doc, deployment="bench", instance=name, rank=0)


def naive_job(job: TransferJob) -> None:
    """One ``copy_`` per concrete copy: block pairs by their fragments, a token range by the
    geometry's reference cutter (``range_copies``), the request's state slot pair once."""
    for leg in job.legs:
        for peer in leg.plan.senders:
            for view in peer.copies:
                src, dst = leg.src_pools[(peer.rank, view.src_pool)], leg.dst_pools[view.dst_pool]
                for sb, so, db, do, length in _naive_copies(job, view):
                    s, d = sb * src.pool.slot_stride + so, db * dst.pool.slot_stride + do
                    dst.tensor[d : d + length].copy_(src.tensor[s : s + length])


def _naive_copies(job: TransferJob, view: ViewCopy) -> list[tuple[int, int, int, int, int]]:
    if view.state:
        pairs = [(job.src_state_slot, job.dst_state_slot)]
    elif job.window is None:
        pairs = list(zip(job.src_blocks.tolist(), job.dst_blocks.tolist(), strict=True))
    else:
        period = view.period
        assert period is not None
        span, src, dst = job.window.lists(
            job.src_blocks, job.dst_blocks, period.src_tokens_per_block,
            period.dst_tokens_per_block,
        )  # fmt: skip
        return range_copies(period, span, src, dst)
    return [(sb, so, db, do, n) for sb, db in pairs for so, do, n in view.fragments.tolist()]


def bench_reblocking(device: torch.device, tokens: int, table: Table) -> None:
    """16 -> 64 and 64 -> 16 tokens per block: a token range, aligned and cut at both ends."""
    for src_tokens, dst_tokens in ((16, 64), (64, 16)):
        src_slots, dst_slots = tokens // src_tokens + 2, tokens // dst_tokens + 2
        sender = rank_document("context", src_tokens, src_slots)
        receiver = rank_document("generation", dst_tokens, dst_slots)
        plan = CopyPlan.from_plan(build_plan([sender], receiver))
        backend = LocalBackend()
        src_bytes, dst_bytes = sender.pools[0].size_bytes, receiver.pools[0].size_bytes
        backend.register("src", torch.randint(0, 256, (src_bytes,), dtype=torch.uint8).to(device))
        backend.register("dst", torch.zeros(dst_bytes, dtype=torch.uint8, device=device))
        cache = PoolMemoryCache([backend])
        leg = TransferLeg(
            plan,
            {(0, 0): cache.open_pool({"backend": "local", "name": "src"}, sender.pools[0])},
            {0: cache.open_pool({"backend": "local", "name": "dst"}, receiver.pools[0])},
        )
        rng = np.random.default_rng(1)
        src_blocks = rng.permutation(src_slots)[: tokens // src_tokens]
        dst_blocks = rng.permutation(dst_slots)[: tokens // dst_tokens]
        for span in (TokenRange(0, tokens), TokenRange(5, tokens - 3)):
            label = f"{src_tokens} -> {dst_tokens} tokens/block, tokens [{span.start}, {span.end}) [{device.type}]"
            job = TransferJob([leg], src_blocks, dst_blocks, window=TokenWindow(span, 0, 0))
            totals = CopyEngine().totals(job)
            shape = f"{totals.fragments / (span.end - span.start):.0f} / token"
            _engine_rows(label, shape, job, device, table)
        cache.close()


def _engine_rows(
    label: str, shape: str, job: TransferJob, device: torch.device, table: Table
) -> None:
    """A job against a contiguous copy of its bytes, the naive loop and every strategy; each
    strategy's receiver bytes must equal the naive loop's."""
    engine = CopyEngine()
    receivers = [memory for leg in job.legs for memory in leg.dst_pools.values()]
    nbytes = engine.totals(job).bytes
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    flat_dst = torch.empty_like(flat_src)
    limit = timed(lambda: flat_dst.copy_(flat_src), device, 5)
    for memory in receivers:
        memory.tensor.zero_()
    naive = timed(lambda: naive_job(job), device, 1)
    reference = [memory.tensor.clone() for memory in receivers]
    table.add_row(label, "contiguous copy", shape, f"{nbytes / limit / 1e9:.2f}", "1.00", "")
    table.add_row(
        label, "naive loop", "", f"{nbytes / naive / 1e9:.2f}", f"{limit / naive:.2f}", "1.0x"
    )
    for strategy in Strategy:
        for memory in receivers:
            memory.tensor.zero_()
        seconds = timed(lambda s=strategy: engine.copy(job, strategy=s), device, 5)
        if any(not torch.equal(m.tensor, r) for m, r in zip(receivers, reference, strict=True)):
            raise SystemExit(f"{strategy} copied wrong bytes for {label}")
        table.add_row(label, str(strategy), "", f"{nbytes / seconds / 1e9:.2f}",
                      f"{limit / seconds:.2f}", f"{naive / seconds:.1f}x")  # fmt: skip


def _hybrid_pools(
    opened_by: tuple[LocalBackend, PoolMemoryCache],
    name: str,
    reg: RankRegistration,
    slots: int,
    device: torch.device,
) -> dict[int, PoolMemory]:
    """Every pool of a rank, ``slots`` slots each: random bytes on the sender, zeros on the
    receiver."""
    backend, cache = opened_by
    opened = {}
    for pool in reg.pools:
        size = slots * pool.slot_bytes
        tensor = (torch.randint(0, 256, (size,), dtype=torch.uint8) if reg.role == "context"
                  else torch.zeros(size, dtype=torch.uint8)).to(device)  # fmt: skip
        backend.register(f"{name}-{pool.pool_id}", tensor)
        memory = Pool(pool.pool_id, pool.slot_bytes, pool.slot_bytes, slots)
        opened[pool.pool_id] = cache.open_pool(
            {"backend": "local", "name": f"{name}-{pool.pool_id}"}, memory
        )
    return opened


def bench_hybrid(device: torch.device, blocks: int, table: Table) -> None:
    """A Nemotron-H-like request (plan_bench.Hybrid) from context TP4 to generation TP2 rank 0:
    its KV blocks of 4 attention layers plus the Mamba2 SSM and conv state of 24 layers, with
    equal blocks and with 32 -> 64 tokens per block (a token range cut mid-block)."""
    for gen_tokens in (32, 64):
        ctx = plan_bench.instance(plan_bench.Hybrid(), "context", "ctx", 4, 1)
        receiver = plan_bench.Hybrid(tokens=gen_tokens)
        gen = plan_bench.instance(receiver, "generation", "gen", 2, 1)
        plan = CopyPlan.from_plan(build_plan(ctx, gen[0]))
        backend, slots = LocalBackend(), blocks + blocks // 2
        cache = PoolMemoryCache([backend])
        opened_by = (backend, cache)
        src_pools = {
            (peer.rank, pool_id): memory
            for peer in plan.senders
            for pool_id, memory in _hybrid_pools(opened_by, f"ctx{peer.rank}", ctx[peer.rank], slots, device).items()
        }  # fmt: skip
        dst_pools = _hybrid_pools(opened_by, "gen0", gen[0], slots, device)
        leg, tokens = TransferLeg(plan, src_pools, dst_pools), blocks * 32
        dst_blocks = np.arange(tokens // gen_tokens)[::-1].copy()
        window, what = None, "block pairs"
        if gen_tokens != 32:
            window, what = TokenWindow(TokenRange(5, tokens - 3), 0), f"tokens [5, {tokens - 3})"
        job = TransferJob([leg], np.arange(blocks), dst_blocks, window=window,
                          src_state_slot=1, dst_state_slot=2)  # fmt: skip
        label = (
            f"Hybrid request, TP4 -> TP2, 32 -> {gen_tokens} tokens/block, {what} [{device.type}]"
        )
        shape = f"{plan.fragments_per_block}/block + {plan.state_fragments} state"
        _engine_rows(label, shape, job, device, table)
        cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = parser.parse_args()
    devices = [torch.device("cpu")] if args.device != "cuda" else []
    if args.device != "cpu" and torch.cuda.is_available():
        devices.append(torch.device("cuda", 0))
    table = figures_table(
        f"kvroute transfer engine, {args.blocks} blocks per job; re-blocking {args.tokens} tokens",
        ("case", "method"),
        ("fragments", "GB/s", "x contiguous", "x naive"),
    )
    verdicts: list[str] = []
    for device in devices:
        bench_device(device, args.blocks, table, verdicts)
        bench_reblocking(device, args.tokens, table)
        bench_hybrid(device, args.blocks, table)
    console = Console(width=150)
    console.print(table)
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
                  f"CUDA available: {torch.cuda.is_available()}")  # fmt: skip
    for verdict in verdicts:
        console.print(verdict)


if __name__ == "__main__":
    main()
