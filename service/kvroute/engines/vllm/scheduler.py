"""The connector's scheduler side: which requests to pull, which blocks to hold for a consumer.

A consumer request carrying a handover (``kv_transfer_params`` from the producer's answer) loads
the prompt's tokens beyond its own prefix-cache hit asynchronously: only that suffix is moved
(a kvroute token range). A producer request that finished its prefill keeps its blocks until the
consumer ranks have pulled them, and answers the handover for the proxy to pass on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvroute.engines.vllm.params import Handover, Settings
from kvroute.engines.vllm.pulls import Load


@dataclass
class StepPlan:
    """What the workers do this step (``KVConnectorMetadata``'s content)."""

    loads: list[Load] = field(default_factory=list)
    sends: dict[str, float] = field(default_factory=dict)  # request id -> hold limit (s)
    # Sampled requests whose blocks each producer rank digests: id -> (block lists, prompt tokens).
    digests: dict[str, tuple[tuple[tuple[int, ...], ...], int]] = field(default_factory=dict)


@dataclass
class SchedulerSide:
    settings: Settings
    block_size: int
    group_ids: tuple[int, ...]  # the KV cache groups that transfer
    matched: dict[str, int] = field(default_factory=dict)  # request id -> local prefix hit
    step: StepPlan = field(default_factory=StepPlan)
    rng: random.Random = field(default_factory=random.Random)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        handover = Handover.from_params(request.kv_transfer_params)
        if handover is None or self.settings.producer:
            return 0, False
        count = min(handover.prompt_tokens, len(request.prompt_token_ids)) - num_computed_tokens
        if count <= 0:
            return 0, False
        self.matched[request.request_id] = num_computed_tokens
        return count, True

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...], external: int) -> None:
        start = self.matched.pop(request.request_id, None)
        handover = Handover.from_params(request.kv_transfer_params)
        if start is None or handover is None or external <= 0:
            return
        groups = tuple(tuple(block_ids[g]) for g in self.group_ids)
        load = Load(
            request.request_id, handover, groups, (start, start + external), self.block_size
        )
        self.step.loads.append(load)
        # Asked once: a retry after a failed load recomputes instead of pulling again.
        request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """(hold the blocks, kv_transfer_params) for a request that finished on this engine."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        if not self.settings.producer or not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or stopped: nothing for a consumer to continue
        groups = tuple(tuple(block_ids[g]) for g in self.group_ids)
        if not any(groups):
            return False, None
        self.step.sends[request.request_id] = self.settings.send_timeout_s
        sampled = self.sample()
        handover = Handover(
            self.settings.instance,
            request.request_id,
            groups,
            first_token=0,
            prompt_tokens=len(request.prompt_token_ids),
            kv_digest=sampled,
        )
        if sampled:
            self.step.digests[request.request_id] = (groups, handover.prompt_tokens)
        return True, handover.to_params()

    def sample(self) -> bool:
        rate = self.settings.kv_digest_rate
        return rate > 0 and (rate >= 1 or self.rng.random() < rate)

    def take_step(self) -> StepPlan:
        step, self.step = self.step, StepPlan()
        return step
