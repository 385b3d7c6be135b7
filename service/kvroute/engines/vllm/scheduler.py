"""The connector's scheduler side: which requests to pull, which blocks to hold for a consumer.

A consumer request carrying a handover (``kv_transfer_params`` from the producer's answer) loads
the prompt's tokens beyond its own prefix-cache hit asynchronously: only that suffix is moved
(a kvroute token range). A producer request that finished its prefill keeps its blocks until the
consumer ranks have pulled them, and answers the handover for the proxy to pass on.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvroute.engines.vllm.params import Handover, Settings
from kvroute.engines.vllm.pulls import Load

log = logging.getLogger(f"vllm.{__name__}")
HELD_BACK = "kvroute_held_back"  # set on a producer's request once its prompt was shortened


@dataclass
class StepPlan:
    """What the workers do this step (``KVConnectorMetadata``'s content)."""

    loads: list[Load] = field(default_factory=list)
    sends: dict[str, float] = field(default_factory=dict)  # request id -> hold limit (s)
    # Handovers this consumer will not pull (aborted before its load, or nothing left to move):
    # each rank tells the producer at once, instead of the producer holding them until its timeout.
    releases: list[Handover] = field(default_factory=list)
    # Sampled requests whose blocks each producer rank digests: id -> (block lists, prompt tokens).
    digests: dict[str, tuple[tuple[tuple[int, ...], ...], int]] = field(default_factory=dict)


@dataclass
class SchedulerSide:
    settings: Settings
    block_size: int
    group_ids: tuple[int, ...]  # the KV cache groups that transfer
    # Prompt tokens a hand-over leaves for the consumer to compute (``connector.holds_back``): 1
    # with recurrent state or windowed attention, as vLLM always recomputes a loaded prompt's last
    # token; so the producer stops at h(N-1) and the consumer computes token N.
    backoff: int = 0
    engine_id: str = ""  # vLLM's, new at every start: the hand-over names it (``Handover``)
    matched: dict[str, int] = field(default_factory=dict)  # request id -> local prefix hit
    step: StepPlan = field(default_factory=StepPlan)
    rng: random.Random = field(default_factory=random.Random)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.settings.producer:
            self._hold_back(request, num_computed_tokens)
            return 0, False
        handover = Handover.from_params(request.kv_transfer_params)
        if handover is None:
            return 0, False
        # Where the producer holds back (``backoff``), so does this side: vLLM would count a window
        # from the token after a wholly loaded prompt and drop the block holding the first token
        # the recomputed last one attends to.
        last = len(request.prompt_token_ids) - self.backoff
        count = min(handover.prompt_tokens, last) - num_computed_tokens
        if count <= 0:
            self._release(request, handover)
            return 0, False
        left_s = handover.remaining_s(time.time(), self.settings.clock_skew_s)
        if left_s <= 0:
            # The producer has freed (or is about to free) the blocks: they may hold another
            # request's KV by now. Nothing to release; the prompt is computed here.
            log.warning("kvroute: the hand-over of %s from %s expired %.1f s ago (its producer "
                        "holds blocks for send_timeout_s); computing its prompt here",
                        request.request_id, handover.instance, -left_s)  # fmt: skip
            request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}
            return 0, False
        self.matched[request.request_id] = num_computed_tokens
        return count, True

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...], external: int) -> None:
        start = self.matched.pop(request.request_id, None)
        handover = Handover.from_params(request.kv_transfer_params)
        if start is None or handover is None or external <= 0:
            return
        groups = self._by_group(block_ids)
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
        if not self.settings.producer:
            handover = Handover.from_params(params)
            if handover is not None:  # finished (aborted) before its load was ever asked
                self._release(request, handover)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if self.backoff and not params.get(HELD_BACK):
            # Not held back (``_hold_back``): nothing a consumer may load; it computes the prompt.
            return False, {"do_remote_prefill": False}
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or stopped: nothing for a consumer to continue
        groups = self._by_group(block_ids)
        if not any(groups):
            return False, None
        self.step.sends[request.request_id] = self.settings.send_timeout_s
        # Stated from before the hold starts (the worker starts it at its next step): a consumer
        # that believes it never reads past the real end.
        expires_at = time.time() + self.settings.send_timeout_s
        sampled = self.sample()
        handover = Handover(
            self.settings.instance,
            request.request_id,
            groups,
            first_token=0,
            prompt_tokens=len(request.prompt_token_ids),
            kv_digest=sampled,
            engine_id=self.engine_id,
            expires_at=int(expires_at * 1000) / 1000,  # rounded down
        )
        if sampled:
            self.step.digests[request.request_id] = (groups, handover.prompt_tokens)
        return True, handover.to_params()

    def _by_group(self, block_ids: tuple[list[int], ...]) -> tuple[tuple[int, ...], ...]:
        """The block lists indexed by vLLM's group id, as the pulls, digests and hand-over read
        them (``RankCache.group_views``); a group that does not transfer gets an empty list."""
        return tuple(
            tuple(blocks) if group in self.group_ids else ()
            for group, blocks in enumerate(block_ids)
        )

    def _hold_back(self, request: Any, num_computed_tokens: int) -> None:
        """Drops the prompt's last ``backoff`` tokens from a request to prefill for a consumer
        (once: a preempted request is asked again); its one sampled token is never used. Not
        where the local prefix cache already holds what would be left (vLLM must compute at least
        one token): that request is answered without a hand-over."""
        params = request.kv_transfer_params
        if (
            not self.backoff
            or not params
            or not params.get("do_remote_decode")
            or params.get(HELD_BACK)
            or request.num_prompt_tokens - self.backoff <= max(num_computed_tokens, 0)
        ):
            return
        del request.prompt_token_ids[-self.backoff :]
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        request.kv_transfer_params = {**params, HELD_BACK: True}

    def _release(self, request: Any, handover: Handover) -> None:
        self.step.releases.append(handover)
        request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}

    def sample(self) -> bool:
        rate = self.settings.kv_digest_rate
        return rate > 0 and (rate >= 1 or self.rng.random() < rate)

    def take_step(self) -> StepPlan:
        step, self.step = self.step, StepPlan()
        return step
