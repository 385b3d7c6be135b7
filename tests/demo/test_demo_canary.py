"""The demo's canary (``kvroute.cli.demo_canary``) without processes or a server: the slots it keeps
back, and the hybrid demo's canary moved by the real plan, checked, and broken one byte at a time.

Pools are the demos' own (``HybridPool``, ``SharedKvPool``) in process memory; ``tests/executor.py``
runs the plans kvroute builds for the demos' registrations. Expected failures are found through the
demos' typed tensors (layer, head, token or SSM head index), never through kvroute's readers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvroute.cli import demo_canary, demo_hybrid, demo_mla, demo_workers  # noqa: E402
from kvroute.cli.demo_hybrid import HybridModel  # noqa: E402
from kvroute.cli.demo_mla import MlaModel  # noqa: E402
from kvroute.cli.demo_workers import WorkerSpec  # noqa: E402
from kvroute.client.hybrid import HybridPool  # noqa: E402
from kvroute.client.integrity import (  # noqa: E402
    check_canary,
    reserved_blocks,
    reserved_state_slot,
    write_canary,
)
from kvroute.client.kv_rows import RowKey  # noqa: E402
from kvroute.client.kv_state import StateKey  # noqa: E402
from kvroute.client.pools import SharedKvPool  # noqa: E402
from kvroute.geometry import RankRegistration, TokenRange, build_plan  # noqa: E402
from tests.executor import Request, execute  # noqa: E402
from tests.world import Layout  # noqa: E402

ROLES = (("context", "ctx0"), ("generation", "gen0"))


def _spec(model: Any, role: str, instance: str, rank: int) -> WorkerSpec[Any]:
    return WorkerSpec("http://unused", "", role, instance, model.tp(role), rank, model, "unused")


def _document(spec: WorkerSpec[Any]) -> dict[str, Any]:
    """The rank's registration, of a one-slot pool described with the demo's whole pool size."""
    model, role = spec.model, spec.role
    slots = demo_canary.pool_slots(model, role)
    if isinstance(model, HybridModel):
        one = HybridPool.carve(*model.layouts(role), 1)
        pool = replace(one, num_slots=slots)
        return demo_hybrid.document(model, role, spec.tp_size, spec.tp_rank, pool)
    layouts = list(model.layouts(role))
    return demo_workers.rank_doc(spec, SharedKvPool.carve(layouts, slots), layouts)


def _request_slots(model: Any, role: str, jobs: list[dict[str, Any]]) -> set[int]:
    side = "src" if role == "context" else "dst"
    held = {slot for job in jobs for slot in job[f"{side}_blocks"]}
    return held | {job[f"{side}_state_slot"] for job in jobs if f"{side}_state_slot" in job}


@pytest.mark.parametrize(
    ("model", "jobs"),
    [
        (demo_workers.SMALL, demo_workers.requests(demo_workers.SMALL, 3)),
        (demo_workers.FULL, demo_workers.requests(demo_workers.FULL, 6)),
        *(
            (m, m.requests())
            for base in (demo_hybrid.SMALL, demo_hybrid.FULL)
            for m in (replace(base, jobs=1), replace(base, jobs=6))
        ),
    ],
    ids=["llama-small", "llama-full", "hybrid-small-1", "hybrid-small-6", "hybrid-1", "hybrid-6"],
)
def test_the_canary_keeps_slots_no_request_uses_and_both_sides_agree_on_them(
    model: Any, jobs: list[dict[str, Any]]
) -> None:
    """The lead's job (``reserved``) names the slots every worker finds from its registration
    (``integrity.reserved_blocks``, ``reserved_state_slot``): inside its pool, apart from every
    request's blocks and state slot."""
    tokens = range(demo_canary.canary_tokens(model))
    for role, instance in ROLES:
        blocks, state = demo_canary.reserved(model, role)
        assert len(blocks) * model.tokens(role) == len(tokens)
        assert (state is not None) == model.has_state
        kept = {*blocks, *([] if state is None else [state])}
        assert len(kept) == demo_canary.pool_slots(model, role) - model.slots(role)
        assert max(kept) < demo_canary.pool_slots(model, role)
        assert not kept & _request_slots(model, role, jobs)
        assert max(_request_slots(model, role, jobs)) < model.slots(role)
        for rank in range(model.ranks(role)):
            spec = _spec(model, role, instance, rank)
            reg = RankRegistration.from_json(
                _document(spec), deployment="demo", instance=instance, rank=rank
            )
            assert reserved_blocks(reg, tokens) == blocks
            assert reserved_state_slot(reg, tokens) == state


class HybridPath:
    """The small hybrid demo's ranks in process memory: each context rank holds the requests and
    the canary as its worker writes them; ``move`` runs a job's real plan into every generation
    rank."""

    def __init__(self, model: HybridModel) -> None:
        self.model = model
        self.specs: dict[str, list[WorkerSpec[HybridModel]]] = {}
        self.pools: dict[str, list[HybridPool]] = {}
        self.docs: dict[str, list[dict[str, Any]]] = {}
        self.regs: dict[str, list[RankRegistration]] = {}
        for role, instance in ROLES:
            slots = demo_canary.pool_slots(model, role)
            self.specs[role] = [_spec(model, role, instance, r) for r in range(model.tp(role))]
            self.pools[role] = [
                HybridPool.carve(*model.layouts(role), slots) for _ in self.specs[role]
            ]
            self.docs[role] = [
                demo_hybrid.document(model, role, s.tp_size, s.tp_rank, p)
                for s, p in zip(self.specs[role], self.pools[role], strict=True)
            ]
            self.regs[role] = [
                RankRegistration.from_json(d, deployment="d", instance=instance, rank=r)
                for r, d in enumerate(self.docs[role])
            ]
        for spec, pool, doc in self.sides("context"):
            for request in model.requests():
                demo_hybrid.write_request(pool, spec.tp_rank, request, "src")
            write_canary(demo_canary.canary_kv(spec, "d", doc, _flat(pool)))

    def sides(self, role: str) -> list[tuple[WorkerSpec[HybridModel], HybridPool, dict[str, Any]]]:
        return list(zip(self.specs[role], self.pools[role], self.docs[role], strict=True))

    def move(self, request: Request) -> None:
        senders = self.regs["context"]
        sender_pools = {r: {0: _flat(p)} for r, p in enumerate(self.pools["context"])}
        sender_layouts = {r: _layout(p) for r, p in enumerate(self.pools["context"])}
        for reg, pool in zip(self.regs["generation"], self.pools["generation"], strict=True):
            plan = build_plan(senders, reg, sender_dp_rank=0).to_json(period=True)
            flat = _flat(pool)
            into = {0: flat}
            out, _ = execute(plan, sender_pools, sender_layouts, _layout(pool), request, into=into)
            flat[:] = out[0]

    def canary(self) -> Request:
        """The canary job as ``demo_canary.attest`` submits it."""
        job = demo_canary.canary_job(self.model)
        span = job.window.tokens
        assert job.src_state_slot is not None
        assert job.dst_state_slot is not None
        pairs = [(job.src_state_slot, job.dst_state_slot)]
        tokens = TokenRange(span.start, span.end)
        return Request(list(job.src), list(job.dst), tokens, (0, 0), pairs, span.end)

    def checks(self) -> list[str | None]:
        """Each generation rank's canary outcome, as its worker reports it."""
        found = []
        for spec, pool, doc in self.sides("generation"):
            failure = check_canary(demo_canary.canary_kv(spec, "d", doc, _flat(pool)))
            found.append(None if failure is None else failure.describe())
        return found


def _flat(pool: HybridPool) -> np.ndarray:
    return pool.buffer.reshape(-1).numpy()


def _layout(pool: HybridPool) -> Layout:
    return Layout({}, pools={0: (pool.slot_bytes, pool.slot_stride, pool.num_slots)})


def test_the_hybrid_canary_crosses_the_real_plan_beside_the_requests() -> None:
    """The canary's blocks and state arrive whole at both generation ranks, and the demo's verify
    (requests, canary, zeros elsewhere) finds every byte of both pools where it should be."""
    path = HybridPath(demo_hybrid.SMALL)
    path.move(path.canary())
    assert path.checks() == [None, None]
    for spec, pool, doc in path.sides("generation"):
        assert demo_hybrid.verify(spec, pool, doc, [])["wrong"] == 0  # the canary wrote no more
    for job in path.model.requests():
        firsts, pair = (
            (job["src_first_token"], None),
            [(job["src_state_slot"], job["dst_state_slot"])],
        )
        tokens = TokenRange(*job["tokens"])
        path.move(Request(job["src_blocks"], job["dst_blocks"], tokens, firsts, pair))
    for spec, pool, doc in path.sides("generation"):
        counts = demo_hybrid.verify(spec, pool, doc, path.model.requests())
        assert counts == {"checked": pool.buffer.numel(), "wrong": 0}
    assert path.checks() == [None, None]  # the requests left the canary's slots alone


def test_a_state_byte_flipped_after_the_write_fails_the_canary_at_its_ssm_head() -> None:
    """Context rank 1 holds global SSM heads 2 and 3 (8 heads over TP4); its head 1's byte 2, in
    Mamba layer 2 (the second of 0, 2, 4), reaches generation rank 0 (heads 0-3) only."""
    path = HybridPath(demo_hybrid.SMALL)
    _, state = demo_canary.reserved(path.model, "context")
    ssm = path.pools["context"][1].ssm[state][1, 1]  # [layer, head] -> [head_dim, d_state]
    ssm.view(torch.uint8).reshape(-1)[2] ^= 0x10
    path.move(path.canary())
    key, byte = _failure(path, rank=0)
    assert isinstance(key, StateKey)
    assert (key.kind, key.layer, key.unit, byte) == ("ssm", 2, 3, 2)
    assert path.checks() == ["target ssm layer 2 SSM head 3, byte 2", None]


def test_a_kv_byte_flipped_in_transit_fails_the_canary_at_its_attention_element() -> None:
    """Generation rank 1 holds global KV heads 2 and 3: a byte of head 3's V, token 5, in the
    second attention layer (6), wrong after the move, is named there; rank 0 still attests."""
    path = HybridPath(demo_hybrid.SMALL)
    path.move(path.canary())
    (block,), _ = demo_canary.reserved(path.model, "generation")
    kv = path.pools["generation"][1].kv
    assert kv is not None
    kv[block][1, 1, 1, 5].view(torch.uint8)[7] ^= 0x01  # [layer, K/V, head, token] -> element bytes
    key, tokens = _failure(path, rank=1)
    assert isinstance(key, RowKey)
    assert (key.layer, key.head, key.buffer, tokens) == (6, 3, 1, (5, 6))
    assert path.checks() == [None, "target key,value layer 6 head 3 V, token 5"]


def _failure(path: HybridPath, rank: int) -> tuple[Any, Any]:
    """The generation rank's first wrong element: its key and its token span or state byte."""
    spec, pool, doc = path.sides("generation")[rank]
    failure = check_canary(demo_canary.canary_kv(spec, "d", doc, _flat(pool)))
    assert failure is not None
    return failure.key, failure.byte if failure.tokens is None else failure.tokens


class MlaPath:
    """A small MLA demo's ranks with context parallelism, in process memory: each context rank
    writes the canary into the blocks it keeps back; ``move`` runs the canary job's real plan
    into every generation CP rank."""

    def __init__(self, model: MlaModel) -> None:
        self.model = model
        self.specs: dict[str, list[WorkerSpec[MlaModel]]] = {}
        self.pools: dict[str, list[torch.Tensor]] = {}
        self.docs: dict[str, list[dict[str, Any]]] = {}
        self.regs: dict[str, list[RankRegistration]] = {}
        for role, instance in ROLES:
            size = demo_canary.pool_slots(model, role) * model.layers * model.layer_bytes(role)
            ranks = range(model.ranks(role))
            self.specs[role] = [_spec(model, role, instance, r) for r in ranks]
            self.pools[role] = [torch.zeros(size, dtype=torch.uint8) for _ in ranks]
            self.docs[role] = [demo_mla.document(model, role, r) for r in ranks]
            self.regs[role] = [
                RankRegistration.from_json(d, deployment="d", instance=instance, rank=r)
                for r, d in enumerate(self.docs[role])
            ]
        for spec, pool, doc in self.sides("context"):
            write_canary(demo_canary.canary_kv(spec, "d", doc, pool.numpy()))

    def sides(self, role: str) -> list[tuple[WorkerSpec[MlaModel], torch.Tensor, dict[str, Any]]]:
        return list(zip(self.specs[role], self.pools[role], self.docs[role], strict=True))

    def words(self, role: str, rank: int) -> torch.Tensor:
        """A rank's whole pool as int16 words [slot, layer, token, element]."""
        model = self.model
        shape = (demo_canary.pool_slots(model, role), model.layers, model.tokens(role), -1)
        return self.pools[role][rank].view(torch.int16).view(shape)

    def move(self) -> None:
        job = demo_canary.canary_job(self.model)
        span = job.window.tokens
        request = Request(list(job.src), list(job.dst), span, (0, 0), (), span.end)
        layout = Layout({}, pools={0: self._pool("context")})
        sender_pools = {r: {0: p.numpy()} for r, p in enumerate(self.pools["context"])}
        for reg, pool in zip(self.regs["generation"], self.pools["generation"], strict=True):
            plan = build_plan(self.regs["context"], reg, prompt_tokens=span.end)
            into = {0: pool.numpy()}
            out, _ = execute(
                plan.to_json(period=True), sender_pools, dict.fromkeys(sender_pools, layout),
                Layout({}, pools={0: self._pool("generation")}), request, into=into,
            )  # fmt: skip
            pool.numpy()[:] = out[0]

    def _pool(self, role: str) -> tuple[int, int, int]:
        slot = self.model.layers * self.model.layer_bytes(role)
        return slot, slot, demo_canary.pool_slots(self.model, role)

    def checks(self) -> list[str | None]:
        found = []
        for spec, pool, doc in self.sides("generation"):
            failure = check_canary(demo_canary.canary_kv(spec, "d", doc, pool.numpy()))
            found.append(None if failure is None else failure.describe())
        return found


def canary_chunk(model: MlaModel, cp_rank: int) -> list[int]:
    """A context CP rank's canary positions in local order: the demo's own chunking
    (``MlaModel.chunk``, torch.tensor_split) of the canary, a prompt of its own."""
    canary = replace(model, prompt_tokens=demo_canary.canary_tokens(model))
    return [int(token) for token in canary.chunk(cp_rank)]


@pytest.mark.parametrize("base", [demo_mla.SMALL, demo_mla.SMALL_ZIGZAG], ids=["tp4", "zigzag"])
def test_the_mla_canary_reaches_each_generation_cp_rank_s_own_positions(base: MlaModel) -> None:
    """Generation TP1 x CP4 (interleave 1): canary token t lands on CP rank t % 4 at local
    position t // 4, whichever context CP rank (zig-zag chunks) held it; every rank attests, and
    its words there are the context side's (read through the demo's tensors)."""
    path = MlaPath(base)
    path.move()
    assert path.checks() == [None] * 4
    tokens = demo_canary.canary_tokens(base)
    (src_block, *_), _ = demo_canary.reserved(base, "context")
    (dst_block, *_), _ = demo_canary.reserved(base, "generation")
    chunks = [canary_chunk(base, r) for r in range(base.context_cp)]
    for token in range(tokens):
        rank, local = token % base.generation_cp, token // base.generation_cp
        holder = next(r for r, chunk in enumerate(chunks) if token in chunk)
        src_local = chunks[holder].index(token)
        src = path.words("context", holder)[src_block, :, src_local]
        assert torch.equal(path.words("generation", rank)[dst_block, :, local], src), token
        assert src.any()


def test_a_byte_flipped_in_a_zigzag_chunk_fails_only_the_cp_rank_holding_its_token() -> None:
    """Context CP rank 1 holds tokens 2-5 of the 8-token canary (zig-zag: chunks 1 and 2 of 4);
    its local position 1 is token 3, which generation CP rank 3 holds: only rank 3 fails, at
    layer 2, token 3."""
    path = MlaPath(demo_mla.SMALL_ZIGZAG)
    assert canary_chunk(path.model, 1) == [2, 3, 4, 5]
    (block, *_), _ = demo_canary.reserved(path.model, "context")
    path.words("context", 1)[block, 2, 1, 5] ^= 0x0100
    path.move()
    assert path.checks() == [None, None, None, "target latent layer 2 replicated K, token 3"]
