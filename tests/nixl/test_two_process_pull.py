"""A real NIXL transfer: a sender process per context rank, the test process as the receiver.

The receiver registers with a live kvroute, fetches its plan over HTTP, reads the senders' NIXL
metadata and pool addresses from their registrations, pulls over UCX on loopback, and checks every
destination byte against the logical KV tensor. The senders see one completion notification each.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid

import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed")
torch = pytest.importorskip("torch")

from kvroute.client import KvrouteClient, RequestBlocks  # noqa: E402
from kvroute.client.nixl_descs import PoolAddress  # noqa: E402
from kvroute.client.nixl_transport import NixlEndpoint, pull_plan  # noqa: E402
from kvroute.client.pools import SharedKvPool, rank_document  # noqa: E402
from tests.client.live import WORKER_TOKEN, LiveServer  # noqa: E402
from tests.nixl import sender, world  # noqa: E402

pytestmark = pytest.mark.slow
REPLY_S = 60.0


@pytest.mark.parametrize("progress_thread", [True, False], ids=["progress-thread", "polled"])
def test_receiver_pulls_a_plan_from_two_sender_processes(
    live_server: LiveServer, progress_thread: bool
) -> None:
    """With NIXL's progress thread on both sides, and without it (the reads progress as the
    receiver checks them, the senders' side as they poll for notifications)."""
    context = multiprocessing.get_context("spawn")
    channels = [(context.Queue(), context.Queue()) for _ in range(2)]
    processes = [
        context.Process(
            target=sender.serve,
            args=(
                live_server.url,
                WORKER_TOKEN,
                2,
                rank,
                f"kvroute-nixl-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                *channels[rank],
                progress_thread,
            ),
            daemon=True,
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    receiver = NixlEndpoint("gen0-rank0", progress_thread=progress_thread)
    try:
        for rank, (_, replies) in enumerate(channels):
            assert replies.get(timeout=REPLY_S) == ("registered", rank)
        target, draft = world.layouts(1)
        pool = SharedKvPool.carve([target, draft], world.BLOCKS)
        flat = pool.buffer.reshape(-1)
        receiver.register(flat)
        src_blocks, dst_blocks = [5, 0, 1, 2], [0, 3, 4, 5]
        with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
            document = rank_document(
                role="generation", target=target, pools=[pool.describe()], num_draft_layers=1
            )
            client.register(world.DEPLOYMENT, "gen0", 0, document)
            plan = client.get_plan(
                world.DEPLOYMENT, sender="ctx0", receiver="gen0", receiver_rank=0
            )
            senders = {
                r: client.get_rank(world.DEPLOYMENT, "ctx0", r).document for r in plan.sending_ranks
            }
        assert plan.sending_ranks == (0, 1)
        assert plan.expected_writers == 2
        for commands, _ in channels:
            commands.put(("await", 1))
        report = pull_plan(
            receiver,
            plan.plan,
            senders,
            receiver_pools={0: PoolAddress(flat.data_ptr(), pool.slot_stride, world.BLOCKS)},
            blocks=RequestBlocks(src_blocks, dst_blocks),
        )
        notified = [replies.get(timeout=REPLY_S) for _, replies in channels]
        logical_target, logical_draft = world.logical()
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(pool.tensors[0][dst], logical_target[src]), (src, dst)
            assert torch.equal(pool.tensors[1][dst], logical_draft[src]), (src, dst)
        untouched = sorted(set(range(world.BLOCKS)) - set(dst_blocks))
        assert not pool.buffer[untouched].any()
        assert report.bytes == plan.bytes_per_block * len(src_blocks)
        assert report.senders == 2
        for tag, messages in notified:
            assert tag == "notified"
            [(agent, message)] = messages
            assert agent == "gen0-rank0"
            assert message == f"kvroute:gen0:0:{plan.fingerprint}"
    finally:
        for commands, _ in channels:
            commands.put(("stop", 0))
        for process in processes:
            process.join(timeout=30)
        receiver.close()
    assert [process.exitcode for process in processes] == [0, 0]
