"""Executes a plan across nodes with NIXL: the receiver pulls (READ) from every sending rank.

kvroute does not move bytes between nodes; it tells the receiver which bytes to read from whom.
A sender registers its pool memory with its NIXL agent and publishes, in its kvroute registration,
the agent's metadata (``nixl_agent_metadata``, base64) and each pool's address in its own address
space (the ``nixl`` member of the pool's ``memory`` descriptor). The receiver loads the senders'
metadata, turns the plan into descriptor lists (``nixl_descs``), posts one READ per sender with a
notification, waits within a bound, and each sender learns from the notification that its blocks
may be freed. Pull, not push: a receiver knows when its destination blocks are ready.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.client.nixl_descs import NixlTransfer, PoolAddress, plan_descriptors
from kvroute.geometry import Plan, RequestBlocks

if TYPE_CHECKING:
    import torch

NIXL_MEMBER = "nixl"  # member of a pool's memory descriptor: {"address", "device", "mem_type"}
LOCAL_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for "my own descriptors" in prep_xfer_dlist


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed, or did not finish within its bound."""


def nixl_memory(address: int, *, device: int = 0, mem_type: str = "DRAM") -> dict[str, Any]:
    return {"address": address, "device": device, "mem_type": mem_type}


def pool_addresses(document: Mapping[str, Any]) -> dict[int, PoolAddress]:
    """Pool id -> address, from a registration document whose pools publish a ``nixl`` member."""
    addresses = {}
    for pool in document["pools"]:
        member = (pool.get("memory") or {}).get(NIXL_MEMBER)
        if member is None:
            continue
        addresses[int(pool["pool_id"])] = PoolAddress(
            base=int(member["address"]),
            slot_stride=int(pool.get("slot_stride", pool["slot_bytes"])),
            num_slots=int(pool["num_slots"]),
            device=int(member.get("device", 0)),
        )
    return addresses


@dataclass(frozen=True, slots=True)
class PullReport:
    bytes: int
    descriptors: int
    senders: int
    seconds: float


class PendingPull:
    """READs posted by ``NixlEndpoint.post``: poll ``state()``, then ``release()`` once; or
    ``wait()``, which does both."""

    def __init__(self, agent: Any, transfer: NixlTransfer) -> None:
        self._agent = agent
        self.transfer = transfer
        self.started = time.perf_counter()
        self.handles: list[Any] = []
        self.dlists: list[Any] = []

    def state(self) -> str:
        """ "DONE" when every read finished, "ERR" when one failed, else "PROC"."""
        states = [self._agent.check_xfer_state(handle) for handle in self.handles]
        if "ERR" in states:
            return "ERR"
        return "DONE" if all(state == "DONE" for state in states) else "PROC"

    def release(self) -> None:
        for handle in self.handles:
            self._agent.release_xfer_handle(handle)
        for dlist in self.dlists:
            self._agent.release_dlist_handle(dlist)
        self.handles, self.dlists = [], []

    def wait(self, limit_s: float = 30.0) -> PullReport:
        """Polls until every read finished, then releases them; raises ``NixlTransferError``
        when one failed or they are still running after ``limit_s``."""
        try:
            deadline = time.monotonic() + limit_s
            while (state := self.state()) != "DONE":
                if state == "ERR":
                    raise NixlTransferError("a NIXL read failed")
                if time.monotonic() > deadline:
                    raise NixlTransferError(f"reads still running after {limit_s} s")
                time.sleep(0.0005)
        finally:
            self.release()
        transfer = self.transfer
        seconds = time.perf_counter() - self.started
        return PullReport(transfer.bytes, transfer.descriptors, len(transfer.peers), seconds)


class NixlEndpoint:
    """One NIXL agent (UCX) with its registered pool memory."""

    def __init__(
        self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = True
    ) -> None:
        """``progress_thread``: NIXL's own (its default), which polls without pause, a core while
        idle; without it reads progress when checked (``PendingPull.state``) and a holder's side
        when it reads its notifications, which suffices on one host and over RDMA."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self._agent = nixl_agent(name, config)
        self._registered: list[Any] = []
        self._peers: set[str] = set()

    def register(self, tensor: torch.Tensor) -> None:
        """Registers a contiguous pool tensor (host or device) for remote access."""
        if not tensor.is_contiguous():
            raise ValueError("NIXL registers contiguous memory; register the pool's flat buffer")
        self._registered.append(self._agent.register_memory(tensor))

    @property
    def metadata(self) -> str:
        """The agent metadata as base64, the form a kvroute registration carries."""
        return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def add_peer(self, metadata: str) -> str:
        """Loads a remote agent's metadata (base64); returns the agent's name."""
        name = self._agent.add_remote_agent(base64.b64decode(metadata))
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def post(
        self,
        transfer: NixlTransfer,
        agents: Mapping[int, str],
        *,
        notification: bytes,
        mem_type: str = "DRAM",
    ) -> PendingPull:
        """Posts one READ per sender and returns at once; ``PendingPull.state()`` polls them,
        ``PendingPull.wait()`` waits for them (each sender is notified on completion)."""
        pending = PendingPull(self._agent, transfer)
        try:
            for peer in transfer.peers:
                local = self._agent.prep_xfer_dlist(LOCAL_AGENT, list(peer.local), mem_type)
                remote = self._agent.prep_xfer_dlist(agents[peer.rank], list(peer.remote), mem_type)
                pending.dlists += [local, remote]
                indices = list(range(len(peer.local)))
                handle = self._agent.make_prepped_xfer(
                    "READ", local, indices, remote, indices, notification
                )
                pending.handles.append(handle)
                if self._agent.transfer(handle) == "ERR":
                    raise NixlTransferError(f"posting the read from sender rank {peer.rank} failed")
        except BaseException:
            pending.release()
            raise
        return pending

    def notify(self, agent: str, message: bytes) -> None:
        """Sends a notification to a loaded peer agent (no data moves)."""
        self._agent.send_notif(agent, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        """The notifications that arrived since the last call, without waiting."""
        received = []
        for agent, messages in self._agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            received += [(name, message) for message in messages]
        return received

    def wait_notifications(self, count: int, *, limit_s: float = 30.0) -> list[tuple[str, bytes]]:
        """Blocks until ``count`` notifications arrived (a sender waiting for its readers)."""
        received: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + limit_s
        while len(received) < count:
            received += self.notifications()
            if len(received) < count:
                if time.monotonic() > deadline:
                    raise NixlTransferError(
                        f"{len(received)} of {count} notifications in {limit_s} s"
                    )
                time.sleep(0.001)
        return received

    def close(self) -> None:
        for name in self._peers:
            self._agent.remove_remote_agent(name)
        self._peers.clear()
        for descs in self._registered:
            self._agent.deregister_memory(descs)
        self._registered.clear()


def pull_plan(
    endpoint: NixlEndpoint,
    plan: Plan,
    sender_documents: Mapping[int, Mapping[str, Any]],
    *,
    receiver_pools: Mapping[int, PoolAddress],
    blocks: RequestBlocks,
    limit_s: float = 30.0,
) -> PullReport:
    """Pulls one plan's blocks (``PlanDocument.plan``): sender documents are the sending ranks'
    registrations (GET rank). ``blocks`` is ``plan_descriptors``': a plan with sliding-window
    views needs the prompt's length, one that moves recurrent state the request's state slot on
    each side."""
    sending = [peer.rank for peer in plan.peers if peer.sends]
    missing = [
        rank for rank in sending if "nixl_agent_metadata" not in sender_documents.get(rank, {})
    ]
    if missing:
        raise ValueError(f"sender ranks {missing} published no nixl_agent_metadata")
    agents = {
        rank: endpoint.add_peer(sender_documents[rank]["nixl_agent_metadata"]) for rank in sending
    }
    transfer = plan_descriptors(
        plan,
        receiver_pools=receiver_pools,
        sender_pools={rank: pool_addresses(sender_documents[rank]) for rank in sending},
        blocks=blocks,
    )
    receiver = f"{plan.receiver_instance}:{plan.receiver_rank}"
    notification = f"kvroute:{receiver}:{plan.fingerprint}".encode()
    return endpoint.post(transfer, agents, notification=notification).wait(limit_s)
