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
from tests.nixl import world

WAIT_S = 60.0


@dataclass
class SenderRank:
    """A context rank's pools (filled by ``world.fill_sender``), NIXL agent and registration."""

    memory: ShmPool
    carved: world.Carved
    endpoint: NixlEndpoint
    flat: Any
    document: dict[str, Any]

    @classmethod
    def open(
        cls,
        tp_size: int,
        tp_rank: int,
        shm_name: str,
        *,
        hybrid: bool = False,
        progress_thread: bool = True,
    ) -> SenderRank:
        memory = ShmPool(shm_name, world.carve(tp_size, hybrid=hybrid).nbytes)
        carved = world.carve(tp_size, hybrid=hybrid, buffer=memory.tensor)
        world.fill_sender(carved, tp_size, tp_rank)
        endpoint = NixlEndpoint(f"ctx0-rank{tp_rank}", progress_thread=progress_thread)
        flat = memory.tensor
        endpoint.register(flat)
        document = carved.document(
            "context",
            world.parallel(tp_size, tp_rank),
            lambda offset: {
                **memory.descriptor(offset),
                "nixl": nixl_memory(flat.data_ptr() + offset),
            },
            nixl_agent_metadata=endpoint.metadata,
        )
        return cls(memory, carved, endpoint, flat, document)

    def close(self) -> None:
        self.endpoint.close()
        del self.carved, self.flat
        self.memory.close()


def serve(
    url: str,
    token: str,
    tp_size: int,
    tp_rank: int,
    shm_name: str,
    commands: Queue,
    replies: Queue,
    progress_thread: bool = True,
) -> None:
    rank = SenderRank.open(tp_size, tp_rank, shm_name, progress_thread=progress_thread)
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
