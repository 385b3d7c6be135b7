"""A context rank in its own process: a NIXL agent over UCX that registers with kvroute and waits.

Started with multiprocessing "spawn". It owns a shared-memory pool, publishes its NIXL metadata and
the pool's address in its registration, then waits for the receiver's completion notifications.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

from kvroute.client import KvrouteClient
from kvroute.client.memory import ShmPool
from kvroute.client.nixl_transport import NixlEndpoint, nixl_memory
from kvroute.client.pools import SharedKvPool, rank_document
from tests.nixl import world

WAIT_S = 60.0


@dataclass
class SenderRank:
    """A context rank's pool (filled from the logical tensor), NIXL agent and registration."""

    memory: ShmPool
    pool: SharedKvPool
    endpoint: NixlEndpoint
    flat: Any
    document: dict[str, Any]

    @classmethod
    def open(cls, tp_size: int, tp_rank: int, shm_name: str) -> SenderRank:
        target, draft = world.layouts(tp_size)
        probe = SharedKvPool.carve([target, draft], world.BLOCKS)
        memory = ShmPool(shm_name, probe.slot_stride * world.BLOCKS)
        pool = SharedKvPool.carve([target, draft], world.BLOCKS, buffer=memory.tensor)
        world.fill_sender(pool, tp_size, tp_rank)
        endpoint = NixlEndpoint(f"ctx0-rank{tp_rank}")
        flat = pool.buffer.reshape(-1)
        endpoint.register(flat)
        descriptor = {**memory.descriptor(), "nixl": nixl_memory(flat.data_ptr())}
        document = rank_document(
            role="context",
            target=target,
            pools=[pool.describe(memory=descriptor)],
            num_draft_layers=1,
            parallel=world.parallel(tp_size, tp_rank),
            nixl_agent_metadata=endpoint.metadata,
        )
        return cls(memory, pool, endpoint, flat, document)

    def close(self) -> None:
        self.endpoint.close()
        del self.pool, self.flat
        self.memory.close()


def serve(
    url: str, token: str, tp_size: int, tp_rank: int, shm_name: str, commands: Queue, replies: Queue
) -> None:
    rank = SenderRank.open(tp_size, tp_rank, shm_name)
    try:
        with KvrouteClient(url, token=token) as client:
            client.register(world.DEPLOYMENT, "ctx0", tp_rank, rank.document)
            replies.put(("registered", tp_rank))
            command, expected = commands.get(timeout=WAIT_S)
            assert command == "await"
            notifications = rank.endpoint.wait_notifications(expected, limit_s=WAIT_S)
            replies.put(
                ("notified", [(agent, message.decode()) for agent, message in notifications])
            )
            commands.get(timeout=WAIT_S)  # "stop": the receiver has verified the bytes
    finally:
        rank.close()
