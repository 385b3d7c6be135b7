"""The consumer's pulls: a handed-over request's tokens read from the producer's ranks over NIXL.

A plan (fetched per producer by ``prefetch``, ``period=True``: any block-size pair cuts token
ranges) says which producer rank holds which bytes; ``kvroute.client.nixl_descs`` turns it and
the block lists into descriptors per KV cache group (its views, its own block table). Once all
reads are done this rank tells every producer rank (each frees the blocks once all consumer ranks
have). A pull that fails or outlives its bound is a load error: its blocks are reported to vLLM,
which recomputes them, and the producer is told. A request that ends before its load was asked
is released the same way: no producer holds blocks for a consumer that will never read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.client.nixl_descs import (
    NixlTransfer,
    PoolAddress,
    merged_transfer,
    plan_descriptors,
)
from kvroute.client.nixl_transport import NixlEndpoint, PendingPull, pool_addresses
from kvroute.engines.vllm.canary import NULL_BLOCK, Canary
from kvroute.engines.vllm.canary_runs import CanaryRuns
from kvroute.engines.vllm.digests import Check, ConsumerChecks
from kvroute.engines.vllm.params import Handover, agent_name, done_message
from kvroute.engines.vllm.prefetch import Fetched, Prefetcher
from kvroute.geometry import Plan, RequestBlocks, TokenRange, TokenWindow

# Under vLLM's logger, whose handlers an engine configures: the lines land in its log.
log = logging.getLogger(f"vllm.{__name__}")
CANARY = "kvroute-canary:"  # the id of a producer instance's canary pull


@dataclass(frozen=True, slots=True)
class Load:
    """One request to pull: the handover, this engine's block lists and the tokens to move."""

    request_id: str
    handover: Handover
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group, from token 0
    tokens: tuple[int, int]  # [start, end): a local prefix-cache hit is not moved again
    block_size: int
    canary: Canary | None = None  # a canary round's pull: only its views move

    def blocks_to_write(self) -> set[int]:
        """The local blocks this load writes (reported when it fails)."""
        start, end = self.tokens
        first, last = start // self.block_size, -(-end // self.block_size)
        return {b for group in self.block_ids for b in group[first:last]}


@dataclass
class _Producer:
    """A producer instance as this rank knows it: its plan, rank documents and NIXL agents."""

    plan: Plan
    documents: Mapping[int, Mapping[str, Any]]
    agents: dict[int, str]
    fetched: Fetched  # what the prefetcher answered (a new answer replaces this producer)

    def started_as(self, instance: str, engine_id: str) -> bool:
        """Whether these are the agents of the engine that started as ``engine_id``."""
        return all(agent == agent_name(instance, engine_id, r) for r, agent in self.agents.items())


@dataclass
class _Running:
    load: Load
    pending: PendingPull
    producer: _Producer
    deadline: float


@dataclass
class Pulls:
    """A consumer rank's pulls in flight; ``poll()`` answers finished and failed request ids.

    Nothing here waits on kvroute: a load whose producer's plan is not fetched yet waits in
    ``waiting`` (bounded by ``timeout_s``) while the ``Prefetcher`` fetches it on its own thread."""

    prefetcher: Prefetcher
    endpoint: NixlEndpoint
    deployment: str
    instance: str
    rank: int
    notifiers: int  # this instance's rank count: each rank tells each producer rank once
    addresses: dict[int, PoolAddress]
    group_views: dict[int, set[int]]
    state_groups: set[int]
    timeout_s: float
    mem_type: str = "DRAM"
    checks: ConsumerChecks | None = None  # sampled requests' digests (``digests``)
    clock_skew_s: float = 1.0  # ``Settings.clock_skew_s``: how a hand-over's expiry is read
    producers: dict[str, _Producer] = field(default_factory=dict)
    waiting: dict[str, tuple[Load, float]] = field(default_factory=dict)  # id -> load, deadline
    releasing: list[tuple[Handover, float]] = field(default_factory=list)  # not to pull; deadline
    running: dict[str, _Running] = field(default_factory=dict)
    errors: dict[str, set[int]] = field(default_factory=dict)  # failed request -> its blocks
    done: set[str] = field(default_factory=set)
    checking: dict[str, _Running] = field(default_factory=dict)  # pulled, digests compared
    refetched: dict[str, str] = field(default_factory=dict)  # instance -> engine id fetched for
    canaries: CanaryRuns | None = None  # with ``checks``: the canaries pulled into block 0

    def start(self, load: Load) -> None:
        """Posts the load's reads, or parks it until its producer's plan is fetched."""
        self.waiting[load.request_id] = (load, time.monotonic() + self.timeout_s)
        self._post_ready()

    def release(self, handover: Handover) -> None:
        """Tells the producer this request will not be pulled, so it frees the blocks now."""
        self.releasing.append((handover, time.monotonic() + self.timeout_s))
        self._tell_ready()

    def _tell_ready(self) -> None:
        """Releases whose producer is known; the rest wait for its fetch, then lapse (the
        producer still frees those blocks on its own timeout)."""
        waiting = []
        for handover, deadline in self.releasing:
            try:
                producer = self._producer(handover.instance, handover.engine_id)
            except Exception:  # kvroute cannot name the producer: its timeout frees the blocks
                continue
            if producer is not None:
                self._tell_producer(producer, handover)
            elif time.monotonic() <= deadline:
                waiting.append((handover, deadline))
        self.releasing = waiting

    def _post_ready(self) -> None:
        for request_id, (load, deadline) in list(self.waiting.items()):
            instance = load.handover.instance
            try:
                producer = self._producer(instance, load.handover.engine_id)
            except Exception as error:  # no plan from kvroute, or NIXL's own errors (a gone peer)
                del self.waiting[request_id]
                self._fail(load, str(error))
                self._forget(instance)
                continue
            if producer is not None:
                del self.waiting[request_id]
                if self._left_s(load) <= 0:
                    self._fail(load, "the producer's hold ended before the reads could start")
                else:
                    self._post(load, producer)
            elif time.monotonic() > deadline:
                del self.waiting[request_id]
                self._fail(load, f"no plan from {instance} after {self.timeout_s} s")

    def _post(self, load: Load, producer: _Producer) -> None:
        try:
            transfer = self._descriptors(producer.plan, load)
            pending = self.endpoint.post(
                transfer, producer.agents, notification=b"", mem_type=self.mem_type
            )
        except Exception as error:  # kvroute, plan and NIXL errors alike (nixl has its own types)
            self._fail(load, f"could not start: {error}")
            self._forget(load.handover.instance)
            return
        deadline = time.monotonic() + min(self.timeout_s, self._left_s(load))
        self.running[load.request_id] = _Running(load, pending, producer, deadline)

    def _left_s(self, load: Load) -> float:
        """Seconds until the producer may free the load's blocks (and reuse them)."""
        return load.handover.remaining_s(time.time(), self.clock_skew_s)

    def poll(self) -> set[str]:
        """Request ids whose pull ended since the last call, failed ones included."""
        self._post_ready()
        if self.releasing:
            self._tell_ready()
        for request_id, running in list(self.running.items()):
            try:
                state = running.pending.state()
            except Exception as error:  # NIXL raises its own errors
                state, detail = "ERR", str(error)
            else:
                detail = "a NIXL read failed"
            if state == "PROC" and time.monotonic() > running.deadline:
                state, detail = (
                    "ERR",
                    "still running at the pull timeout or the producer's hold end",
                )
            elif state == "DONE" and self._left_s(running.load) <= 0:
                # Seen done only after the producer's hold ended: a read may have landed after
                # the producer freed (and reused) the block. Not trusted.
                state, detail = "ERR", "the reads were seen done after the producer's hold ended"
            if state == "PROC":
                continue
            del self.running[request_id]
            self._release(running.pending)
            if request_id.startswith(CANARY):
                self._canary_pulled(state)
            elif state == "DONE" and running.load.handover.kv_digest and self.checks is not None:
                self.checking[request_id] = running
                self.checks.submit(_check(running))
            elif state == "DONE":
                self._tell_producer(running.producer, running.load.handover)
                self.done.add(request_id)
            else:
                # A failed load is recomputed here: the producer may free the blocks now.
                self._tell_producer(running.producer, running.load.handover)
                self._fail(running.load, detail)
                self._forget(running.load.handover.instance)
        self._checked()
        if self.canaries is not None:
            self._canary_round(self.canaries.checked())
        finished, self.done = self.done, set()
        return finished

    def _checked(self) -> None:
        """Sampled requests whose digests were compared: wrong KV is a load error (recomputed)."""
        for check, failure in self.checks.finished() if self.checks is not None else ():
            running = self.checking.pop(check.request_id)
            # The producer may free its blocks either way.
            self._tell_producer(running.producer, running.load.handover)
            if failure is None:
                self.done.add(check.request_id)
            else:
                self._fail(running.load, failure)

    def take_errors(self) -> dict[str, set[int]]:
        errors, self.errors = self.errors, {}
        return errors

    def _canary_load(self, instance: str, documents: Mapping[int, Mapping[str, Any]]) -> None:
        """Queues the producer's canary at first pairing and whenever its plan was fetched again
        (it registered again): one canary at a time, round by round, into this rank's block 0."""
        if self.checks is None or not documents:
            return
        canary = self.checks.memory.canary_for(documents, instance)
        if not canary.rounds:
            log.warning("kvroute: the canary from %s covers none of this rank's views", instance)
            return
        if self.canaries is None:
            self.canaries = CanaryRuns(self.checks)
        self._canary_round(self.canaries.add(canary))

    def _canary_round(self, canary: Canary | None) -> None:
        """Zeroes this rank's block 0 under the round's views and pulls them: every group's null
        block on both sides."""
        if canary is None or self.checks is None or self.canaries is None:
            return
        self.checks.memory.clear(canary)
        blocks = ((NULL_BLOCK,),) * (max(self.group_views, default=0) + 1)
        request_id = CANARY + canary.instance
        handover = Handover(canary.instance, request_id, blocks, 0, canary.tokens)
        mine = self.checks.memory.reg.tokens_per_block
        load = Load(request_id, handover, blocks, (0, canary.tokens), mine, canary)
        self.canaries.pulling()
        self.waiting[request_id] = (load, time.monotonic() + self.timeout_s)

    def _canary_pulled(self, state: str) -> None:
        assert self.canaries is not None
        if state != "DONE":  # a transport failure, not a layout's: the next pairing tries again
            log.warning("kvroute: a canary pull did not complete (%s)", state)
        self._canary_round(self.canaries.pulled(state == "DONE"))

    def _fail(self, load: Load, detail: str) -> None:
        if load.request_id.startswith(CANARY):  # no request's blocks: nothing to recompute
            log.warning("kvroute: the canary pull from %s failed: %s", load.handover.instance,
                        detail)  # fmt: skip
            if self.canaries is not None:
                self._canary_round(self.canaries.ended())
            return
        log.warning("kvroute pull of %s from %s failed: %s", load.request_id,
                    load.handover.instance, detail)  # fmt: skip
        self.errors[load.request_id] = load.blocks_to_write()
        self.done.add(load.request_id)

    @staticmethod
    def _release(pending: PendingPull) -> None:
        try:
            pending.release()
        except Exception:  # releasing a failed read may fail again
            log.debug("releasing a failed NIXL read failed", exc_info=True)

    def _tell_producer(self, producer: _Producer, handover: Handover) -> None:
        message = done_message(handover.request_id, self.notifiers)
        for agent in producer.agents.values():
            try:
                self.endpoint.notify(agent, message)
            except Exception:  # the producer frees the blocks on its timeout
                log.warning("could not tell %s that it may free %s", agent, handover.request_id)

    def _producer(self, instance: str, engine_id: str = "") -> _Producer | None:
        """The producer's plan and agents; None while the prefetcher fetches them; LookupError
        when kvroute could not answer (the load fails and vLLM recomputes it). A hand-over that
        names another engine (``engine_id``) than the one planned for means the producer
        restarted: its plan and agents are fetched again, once; if kvroute still knows another
        engine, the hand-over's blocks are gone with it (LookupError)."""
        producer = self._known(instance)
        if producer is None or not engine_id or producer.started_as(instance, engine_id):
            return producer
        if self.refetched.get(instance) == engine_id:
            raise LookupError(
                f"the hand-over names engine {engine_id} of {instance}, which kvroute no longer "
                "knows (it restarted): its blocks are gone"
            )
        log.info("kvroute: %s restarted as engine %s; fetching its plan again", instance,
                 engine_id)  # fmt: skip
        self.refetched[instance] = engine_id
        self._forget(instance)
        return None

    def _known(self, instance: str) -> _Producer | None:
        fetched = self.prefetcher.get(instance)
        known = self.producers.get(instance)
        if fetched is None:
            self.producers.pop(instance, None)  # dropped by the prefetcher: stale
            return None
        if known is not None and known.fetched is fetched:
            return known
        if fetched.plan is None:
            self.prefetcher.forget(instance)
            raise LookupError(fetched.error)
        agents = {}
        for rank, document in fetched.documents.items():
            metadata = document.get("nixl_agent_metadata")
            if metadata is None:
                self.prefetcher.forget(instance)
                raise LookupError(f"producer {instance} rank {rank} published no NIXL metadata")
            agents[rank] = self.endpoint.add_peer(metadata)
        producer = _Producer(fetched.plan, dict(fetched.documents), agents, fetched)
        self.producers[instance] = producer
        self._canary_load(instance, fetched.documents)
        return producer

    def _forget(self, instance: str) -> None:
        self.producers.pop(instance, None)
        self.prefetcher.forget(instance)

    def _descriptors(self, plan: Plan, load: Load) -> NixlTransfer:
        """One transfer: each KV cache group's views with that group's block lists."""
        senders = [peer.rank for peer in plan.peers if peer.sends]
        producer = self.producers[load.handover.instance]
        sender_pools = {rank: pool_addresses(producer.documents[rank]) for rank in senders}
        parts = []
        for group, views in sorted(self.group_views.items()):
            if load.canary is not None:
                views = views & load.canary.views
                if not views:
                    continue
            if group >= len(load.block_ids) or group >= len(load.handover.block_ids):
                raise ValueError(f"the handover has no block list for KV cache group {group}")
            src, dst = load.handover.block_ids[group], load.block_ids[group]
            if not src and not dst:  # a group that does not transfer (``SchedulerSide``)
                continue
            prompt = load.handover.prompt_tokens
            if group in self.state_groups:  # the group's last block is the request's state slot
                blocks = RequestBlocks([], [], TokenWindow(prompt_tokens=prompt), src[-1], dst[-1])
            else:
                # Windows are measured from the first token computed here: the load's end.
                tokens = TokenRange(*load.tokens)
                window = TokenWindow(tokens, load.handover.first_token, 0, load.tokens[1])
                blocks = RequestBlocks(src, dst, window)
            parts.append(
                plan_descriptors(
                    _only_views(plan, views),
                    receiver_pools=self.addresses,
                    sender_pools=sender_pools,
                    blocks=blocks,
                )
            )
        return merged_transfer(parts, plan.expected_writers)


def _check(running: _Running) -> Check:
    load = running.load
    return Check(
        request_id=load.request_id,
        producer=load.handover.instance,
        producer_request=load.handover.request_id,
        senders=frozenset(peer.rank for peer in running.producer.plan.peers if peer.sends),
        blocks=load.block_ids,
        tokens=load.tokens,
        prompt_tokens=load.handover.prompt_tokens,
        documents=running.producer.documents,
    )


def _only_views(plan: Plan, views: set[int]) -> Plan:
    """The plan restricted to the view pairs (and states) landing in ``views``; a rank left with
    none sends nothing here (the whole plan's writers still notify, ``_merged``)."""
    peers = tuple(
        replace(
            peer,
            views=tuple(view for view in peer.views if view.dst_view in views),
            states=tuple(state for state in peer.states if state.dst_view in views),
        )
        for peer in plan.peers
    )
    return replace(plan, peers=peers)
