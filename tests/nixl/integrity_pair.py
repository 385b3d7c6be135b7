"""The two sides of the NIXL integrity tests: context ranks in their own processes
(``tests.nixl.integrity_sender``) and the generation rank in the test process, over a live kvroute.

``Senders`` asks each context rank to write the canary, digest a request, flip a bit or hand back
its kernels' bytes; ``Receiver`` registers the generation rank (truthfully, or with a registration
that lies about its layout), fetches its plan, pulls with the real plan and NIXL, and checks and
reports what it received. Dense or hybrid (``tests.nixl.world``).
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvroute.client import KvrouteClient
from kvroute.client.integrity import (
    canary_tokens,
    check_canary,
    path_report,
    reserved_blocks,
    reserved_state_slot,
)
from kvroute.client.kv_digest import KvDigest, Mismatch, kv_digest
from kvroute.client.kv_rows import RequestKv, window_firsts
from kvroute.client.nixl_descs import PoolAddress
from kvroute.client.nixl_transport import NixlEndpoint, pull_plan
from kvroute.geometry import BLOCK_PAIRS, RankRegistration, RequestBlocks, TokenWindow
from tests.client.live import WORKER_TOKEN
from tests.nixl import integrity_sender, world

REPLY_S = 120.0
Lie = Callable[[dict[str, Any]], None]  # what a lying receiver does to its registration


@dataclass
class Senders:
    channels: list[tuple[Any, Any]]
    processes: list[Any] = field(default_factory=list)

    def ask(self, rank: int, *command: Any) -> tuple[Any, ...]:
        commands, replies = self.channels[rank]
        commands.put(command)
        return tuple(replies.get(timeout=REPLY_S))

    def digest(
        self, blocks: list[int], tokens: range, chunk: int, state_slot: int | None = None
    ) -> KvDigest:
        """Both ranks' digests of a request as they hold it, merged as kvroute's store does."""
        merged = KvDigest((tokens.start, tokens.stop), chunk)
        for rank in range(len(self.channels)):
            _, doc = self.ask(rank, "digest", blocks, tokens.start, tokens.stop, chunk, state_slot)
            merged.merge(KvDigest.from_json(doc))
        return merged


@contextmanager
def started_senders(url: str, *, hybrid: bool = False) -> Iterator[Senders]:
    """Context ranks 0 and 1 (TP2) of instance ``ctx0``, registered with kvroute at ``url``."""
    context = multiprocessing.get_context("spawn")
    running = Senders([(context.Queue(), context.Queue()) for _ in range(2)])
    for rank in range(2):
        name = f"kvroute-int-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        process = context.Process(
            target=integrity_sender.serve,
            args=(url, WORKER_TOKEN, 2, rank, name, *running.channels[rank], hybrid),
            daemon=True,
        )
        process.start()
        running.processes.append(process)
    try:
        for rank, (_, replies) in enumerate(running.channels):
            assert replies.get(timeout=REPLY_S) == ("registered", rank)
        yield running
    finally:
        for commands, _ in running.channels:
            commands.put(("stop",))
        for process in running.processes:
            process.join(timeout=30)
    assert [process.exitcode for process in running.processes] == [0, 0]


def says_head_buffer(view: int) -> Lie:
    """A registration that says view ``view``'s kernels keep each head's K then V: they keep
    every K, then every V."""

    def lie(document: dict[str, Any]) -> None:
        tile = {"planes": 1, "token_group": 1}
        document["views"][view]["interior"] = {"order": "head_buffer", "tilings": [tile, tile]}

    return lie


class Receiver:
    """The generation rank: its pools, what it registered, and what its kernels read."""

    def __init__(
        self, url: str, instance: str, *, hybrid: bool = False, lie: Lie | None = None
    ) -> None:
        self.url, self.instance, self.hybrid = url, instance, hybrid
        self.carved = world.carve(1, hybrid=hybrid)
        self.endpoint = NixlEndpoint(f"{instance}-rank0")
        self.endpoint.register(self.carved.buffer)
        self.document = self.carved.document("generation")
        if lie is not None:
            lie(self.document)
        self.reg = RankRegistration.from_json(  # its kernels' view: the truthful document
            self.carved.document("generation"), deployment=world.DEPLOYMENT, instance=instance,
            rank=0,
        )  # fmt: skip
        with KvrouteClient(url, token=WORKER_TOKEN) as client:
            client.register(world.DEPLOYMENT, instance, 0, self.document)
            self.plan = client.get_plan(
                world.DEPLOYMENT, sender="ctx0", receiver=instance, receiver_rank=0, period=hybrid
            )
            self.senders = {
                r: client.get_rank(world.DEPLOYMENT, "ctx0", r).document
                for r in self.plan.sending_ranks
            }
        self.sender_regs = [
            RankRegistration.from_json(doc, deployment=world.DEPLOYMENT, instance="ctx0", rank=r)
            for r, doc in self.senders.items()
        ]

    @property
    def pools(self) -> dict[int, Any]:
        return {i: self.carved.flat(i).numpy() for i in range(len(self.carved.pools))}

    def pull(
        self,
        src: list[int],
        dst: list[int],
        *,
        prompt: int | None = None,
        states: tuple[int | None, int | None] = (None, None),
        read_shift: int = 0,
        shift_pool: int = 0,
    ) -> None:
        """Pulls ``src`` into ``dst`` (a ``prompt``-token request, and its state slots), every
        read of the senders' pool ``shift_pool`` ``read_shift`` bytes off."""
        senders = copy.deepcopy(self.senders)
        for document in senders.values():
            document["pools"][shift_pool]["memory"]["nixl"]["address"] += read_shift
        addresses = {
            i: PoolAddress(self.carved.flat(i).data_ptr(), pool.slot_stride, world.BLOCKS)
            for i, pool in enumerate(self.carved.pools)
        }
        window = BLOCK_PAIRS if prompt is None else TokenWindow(prompt_tokens=prompt)
        pull_plan(
            self.endpoint, self.plan.plan, senders, receiver_pools=addresses,
            blocks=RequestBlocks(src, dst, window, *states),
        )  # fmt: skip

    def digest(
        self, blocks: list[int], tokens: range, chunk: int, state_slot: int | None = None
    ) -> KvDigest:
        """Its digests of a request it pulled: a window over what the pair moved."""
        firsts = window_firsts(self.reg, tokens.stop, self.sender_regs)
        return kv_digest(RequestKv(self.reg, self.pools, blocks, tokens, firsts, state_slot), chunk)

    def canary_places(self) -> tuple[range, list[int], list[int], tuple[int | None, int | None]]:
        """The canary's tokens, the senders' and its own reserved blocks and state slots."""
        sender = self.sender_regs[0]
        tokens = canary_tokens(sender, self.reg)
        slots = (reserved_state_slot(sender, tokens), reserved_state_slot(self.reg, tokens))
        return tokens, reserved_blocks(sender, tokens), reserved_blocks(self.reg, tokens), slots

    def canary(
        self,
        senders: Senders,
        *,
        read_shift: int = 0,
        shift_pool: int = 0,
        fault: Callable[[], None] | None = None,
    ) -> tuple[Mismatch | None, float]:
        """Pulls and checks the canary (``fault`` runs between its write and the pull); (its first
        wrong element, milliseconds it took)."""
        tokens, src, dst, slots = self.canary_places()
        for rank in range(len(senders.channels)):
            assert senders.ask(rank, "canary", len(tokens)) == ("written",)
        if fault is not None:
            fault()
        started = time.perf_counter()
        prompt = len(tokens) if self.hybrid else None
        self.pull(src, dst, prompt=prompt, states=slots, read_shift=read_shift,
                  shift_pool=shift_pool)  # fmt: skip
        firsts = window_firsts(self.reg, len(tokens), self.sender_regs)
        failure = check_canary(RequestKv(self.reg, self.pools, dst, tokens, firsts, slots[1]))
        return failure, (time.perf_counter() - started) * 1e3

    def report(self, source: str, failure: Mismatch | None, cost_ms: float | None = None) -> Any:
        with KvrouteClient(self.url, token=WORKER_TOKEN) as client:
            body = path_report("ctx0", self.instance, 0, source, failure, cost_ms)
            return client.report_kv_path(world.DEPLOYMENT, body)

    def excluded(self) -> dict[str, str]:
        with KvrouteClient(self.url, token=WORKER_TOKEN) as client:
            pairs = client.pairs(world.DEPLOYMENT, generation=self.instance)
        return {item.context: item.code for item in pairs.generation[0].excluded}

    def close(self) -> None:
        self.endpoint.close()


def metrics(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as answer:
        return str(answer.read().decode())
