"""KV integrity over a real NIXL pull (UCX on loopback), with faults injected in transit.

Two context ranks (TP2, ``tests.nixl.integrity_sender``) write the canary into their reserved block
and digest a request's blocks as they produced them; the test process is the generation rank
(TP1): it pulls the canary with the real plan and transport, checks it through its kernels' view of
its layout, digests what a request brought, and reports each outcome to a live kvroute. Faults:
the sender's pool read 2 bytes off (a read into the wrong offset), a bit flipped in a producer block
after the write (and after its digest), and a consumer whose registration lies about its layout.
Each is caught, names its first wrong element, fails the path (the pairs answer leaves the pair out)
and, for a digest, marks the request's blocks for recompute.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed")
torch = pytest.importorskip("torch")

from kvroute.client import KvrouteClient  # noqa: E402
from kvroute.client.integrity import (  # noqa: E402
    canary_tokens,
    check_canary,
    path_report,
    reserved_blocks,
)
from kvroute.client.kv_digest import KvDigest, Mismatch, kv_digest  # noqa: E402
from kvroute.client.kv_rows import RowKey  # noqa: E402
from kvroute.client.nixl_descs import PoolAddress  # noqa: E402
from kvroute.client.nixl_transport import NixlEndpoint, pull_plan  # noqa: E402
from kvroute.client.pools import SharedKvPool, rank_document  # noqa: E402
from kvroute.geometry import RankRegistration  # noqa: E402
from tests.client.live import WORKER_TOKEN, LiveServer  # noqa: E402
from tests.nixl import integrity_sender, world  # noqa: E402

pytestmark = pytest.mark.slow
REPLY_S = 120.0
SRC_BLOCKS, DST_BLOCKS = [1, 2, 3, 4], [0, 3, 4, 5]  # the request: prompt tokens 0-15
REQUEST = range(0, 4 * world.TOKENS)


@dataclass
class Senders:
    channels: list[tuple[Any, Any]]
    processes: list[Any] = field(default_factory=list)

    def ask(self, rank: int, *command: Any) -> tuple[Any, ...]:
        commands, replies = self.channels[rank]
        commands.put(command)
        return tuple(replies.get(timeout=REPLY_S))

    def digest(self, chunk: int) -> KvDigest:
        merged = KvDigest((REQUEST.start, REQUEST.stop), chunk)
        for rank in range(2):
            _, doc = self.ask(rank, "digest", SRC_BLOCKS, REQUEST.start, REQUEST.stop, chunk)
            merged.merge(KvDigest.from_json(doc))
        return merged


@pytest.fixture
def senders(live_server: LiveServer) -> Iterator[Senders]:
    context = multiprocessing.get_context("spawn")
    running = Senders([(context.Queue(), context.Queue()) for _ in range(2)])
    for rank in range(2):
        name = f"kvroute-int-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        process = context.Process(
            target=integrity_sender.serve,
            args=(live_server.url, WORKER_TOKEN, 2, rank, name, *running.channels[rank]),
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


class Receiver:
    """The generation rank: its pool, what it registered, and what its kernels read."""

    def __init__(self, url: str, instance: str, *, lies: bool = False) -> None:
        self.url, self.instance = url, instance
        self.kernels, draft = world.layouts(1)
        self.pool = SharedKvPool.carve([self.kernels, draft], world.BLOCKS)
        self.flat = self.pool.buffer.reshape(-1)
        self.endpoint = NixlEndpoint(f"{instance}-rank0")
        self.endpoint.register(self.flat)
        self.document = rank_document(
            role="generation", target=self.kernels, pools=[self.pool.describe()], num_draft_layers=1
        )
        if lies:  # says its kernels keep each head's K then V: they keep every K, then every V
            tile = {"planes": 1, "token_group": 1}
            interior = {"order": "head_buffer", "tilings": [tile, tile]}
            self.document["views"][0]["interior"] = interior
        truth = rank_document(
            role="generation", target=self.kernels, pools=[self.pool.describe()], num_draft_layers=1
        )
        self.reg = RankRegistration.from_json(
            truth, deployment=world.DEPLOYMENT, instance=instance, rank=0
        )
        with KvrouteClient(url, token=WORKER_TOKEN) as client:
            client.register(world.DEPLOYMENT, instance, 0, self.document)
            self.plan = client.get_plan(
                world.DEPLOYMENT, sender="ctx0", receiver=instance, receiver_rank=0
            )
            self.senders = {
                r: client.get_rank(world.DEPLOYMENT, "ctx0", r).document
                for r in self.plan.sending_ranks
            }

    @property
    def pools(self) -> dict[int, Any]:
        return {0: self.flat.numpy()}

    def pull(self, src: list[int], dst: list[int], *, read_shift: int = 0) -> None:
        senders = copy.deepcopy(self.senders)
        for document in senders.values():  # a read ``read_shift`` bytes off the sender's blocks
            document["pools"][0]["memory"]["nixl"]["address"] += read_shift
        address = PoolAddress(self.flat.data_ptr(), self.pool.slot_stride, world.BLOCKS)
        pull_plan(
            self.endpoint, self.plan.plan, senders, receiver_pools={0: address},
            src_blocks=src, dst_blocks=dst,
        )  # fmt: skip

    def canary(self, senders: Senders, *, read_shift: int = 0) -> tuple[Mismatch | None, float]:
        """Pulls and checks the canary; (its first wrong element, milliseconds it took)."""
        sender = RankRegistration.from_json(
            self.senders[0], deployment=world.DEPLOYMENT, instance="ctx0", rank=0
        )
        tokens = canary_tokens(sender, self.reg)
        for rank in range(2):
            assert senders.ask(rank, "canary", len(tokens)) == ("written",)
        started = time.perf_counter()
        src, dst = reserved_blocks(sender, tokens), reserved_blocks(self.reg, tokens)
        self.pull(src, dst, read_shift=read_shift)
        failure = check_canary(self.reg, self.pools, dst, tokens)
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


@pytest.fixture
def receiver(live_server: LiveServer, senders: Senders, request: Any) -> Iterator[Receiver]:
    lies = getattr(request, "param", False)
    made = Receiver(live_server.url, "gen1" if lies else "gen0", lies=lies)
    try:
        yield made
    finally:
        made.close()


def test_a_clean_path_is_attested_and_its_digests_agree(
    receiver: Receiver, senders: Senders
) -> None:
    failure, cost_ms = receiver.canary(senders)
    assert failure is None
    path = receiver.report("canary", None, cost_ms)
    assert (path.state, path.source) == ("attested", "canary")
    sent = senders.digest(chunk=256)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    got = kv_digest(receiver.reg, receiver.pools, DST_BLOCKS, REQUEST, 256)
    assert sent.shared(got) == len(got.rows) > 0
    assert sent.first_mismatch(got) is None
    assert receiver.excluded() == {}


def test_a_bit_flipped_after_the_write_is_caught_by_the_digest(
    receiver: Receiver, senders: Senders
) -> None:
    sent = senders.digest(chunk=1)  # as the producer computed it, before the fault
    # Sender rank 1 (global heads 2, 3): src block 2 holds tokens 4-7; layer 1, V, its head 0.
    assert senders.ask(1, "flip", (2, 1, 1, 0, 3, 5)) == ("flipped",)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    found = sent.first_mismatch(kv_digest(receiver.reg, receiver.pools, DST_BLOCKS, REQUEST, 1))
    assert found is not None
    assert (found.key, found.tokens) == (RowKey("target", "key,value", 1, 2, 1), (7, 8))
    path = receiver.report("digest", found)
    assert (path.state, path.element["detail"]) == (
        "failed",
        "target key,value layer 1 head 2 V, token 7",
    )
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    metrics = _metrics(receiver.url)
    assert 'kvroute_kv_digest_mismatch_total{consumer="gen0",producer="ctx0"} 1.0' in metrics
    # The flip is in a request's block, not in the canary's: the path's transport is sound.
    failure, _ = receiver.canary(senders)
    assert failure is None


def test_a_read_at_the_wrong_offset_fails_the_canary(receiver: Receiver, senders: Senders) -> None:
    failure, _ = receiver.canary(senders, read_shift=-2)
    assert failure is not None
    assert (failure.key.layer, failure.key.buffer, failure.tokens) == (0, 0, (0, 1))
    path = receiver.report("canary", failure)
    assert path.state == "failed"
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    # With digests off, nothing checks a request's bytes: the next canary catches the fault again.
    again, _ = receiver.canary(senders, read_shift=-2)
    assert again == failure


@pytest.mark.parametrize("receiver", [True], indirect=True, ids=["lying"])
def test_a_registration_that_lies_about_its_layout_fails_the_canary_and_the_digest(
    receiver: Receiver, senders: Senders
) -> None:
    """The consumer registers a per-head K-then-V interior while its kernels read every K, then
    every V: kvroute plans writes to where the registration says, which its kernels do not read."""
    failure, _ = receiver.canary(senders)
    assert failure is not None
    receiver.report("canary", failure)
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    sent = senders.digest(chunk=256)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    got = kv_digest(receiver.reg, receiver.pools, DST_BLOCKS, REQUEST, 256)
    assert sent.first_mismatch(got) is not None


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as answer:
        return str(answer.read().decode())
