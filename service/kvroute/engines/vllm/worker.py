"""The connector's worker side: register this rank with kvroute, then pull or hold blocks.

At start-up (``register_kv_caches``) the rank's registration is derived from what vLLM hands
over (``layout.describe``), its backing allocation is registered with a NIXL agent whose metadata
goes into the registration, and the rank registers with a lease kept in the background. A refusal
stops start-up with kvroute's code, field and both values. Per step, a producer rank counts the
consumers' "done" notifications for the requests whose blocks it holds; a consumer rank pulls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvroute.client import KvrouteClient, KvrouteError, SyncLease
from kvroute.client.nixl_transport import NixlEndpoint
from kvroute.client.pool_access import PoolAccess
from kvroute.engines.vllm.backends import checked_layouts
from kvroute.engines.vllm.canary import NULL_BLOCK
from kvroute.engines.vllm.digests import ConsumerChecks, ProducerDigests
from kvroute.engines.vllm.layout import Layer, RankCache, describe
from kvroute.engines.vllm.memory import RankMemory
from kvroute.engines.vllm.params import Settings, agent_name, parse_done
from kvroute.engines.vllm.place import engine_place
from kvroute.engines.vllm.prefetch import Prefetcher
from kvroute.engines.vllm.probe import Layout
from kvroute.engines.vllm.pulls import Load, Pulls
from kvroute.geometry import Owner

if TYPE_CHECKING:
    import torch

    from kvroute.engines.vllm.scheduler import StepPlan

# Under vLLM's logger, whose handlers an engine configures: the lines land in its log.
log = logging.getLogger(f"vllm.{__name__}")


class RegistrationRefused(RuntimeError):
    """kvroute refused this rank's geometry: the engine must not start."""

    def __init__(self, error: KvrouteError, instance: str, rank: int) -> None:
        peer = (
            f" (peer {error.peer_instance} rank {error.peer_rank})" if error.peer_instance else ""
        )
        super().__init__(
            f"kvroute refused {instance} rank {rank}: {error.code} on field {error.field!r}: "
            f"local {error.local!r}, peer {error.peer!r}{peer}: {error.detail}"
        )
        self.error = error


def engine_layers(kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]) -> list[Layer]:
    """Every transferable layer with its spec, owner and id; draft ids renumbered from 0."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    found = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not group.enable_kv_transfer:
            continue
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            # ``is_draft`` exists from vLLM 0.34 on; 0.32 marks draft layers by their group only.
            draft = getattr(spec, "is_draft", False) or getattr(group, "is_eagle_group", False)
            found.append((name, spec, draft, group_id, extract_layer_index(name)))
    drafts = sorted({index for _, _, draft, _, index in found if draft})
    return [
        Layer(
            name,
            drafts.index(index) if draft else index,
            Owner.DRAFT if draft else Owner.TARGET,
            spec,
            kv_caches[name],
            group_id,
        )
        for name, spec, draft, group_id, index in found
    ]


def total_kv_heads(vllm_config: Any) -> dict[Owner, int | None]:
    totals: dict[Owner, int | None] = {
        Owner.TARGET: vllm_config.model_config.get_total_num_kv_heads()
    }
    speculative = vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None) if speculative else None
    totals[Owner.DRAFT] = draft.get_total_num_kv_heads() if draft is not None else None
    return totals


def rank_cache(
    vllm_config: Any,
    kv_cache_config: Any,
    kv_caches: dict[str, torch.Tensor],
    lease: int = 30,
    layouts: Mapping[str, Layout] | None = None,
) -> RankCache:
    """The rank's registration derived from vLLM's objects (without NIXL metadata or role).

    Attention layers are described as the layout probe finds them through their backend's own
    cache update (``layouts`` when the caller probed already)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    layers = engine_layers(kv_cache_config, kv_caches)
    if layouts is None:
        layouts = checked_layouts(vllm_config, layers)
    return describe(
        layers,
        layouts=layouts,
        place=engine_place(vllm_config),
        total_kv_heads=total_kv_heads(vllm_config),
        conv_dim_first=is_conv_state_dim_first(),
        num_draft_layers=len({layer.layer_id for layer in layers if layer.owner is Owner.DRAFT}),
        lease_seconds=lease,
    )


def _storages(kv_caches: Mapping[str, torch.Tensor]) -> list[Any]:
    """Each distinct allocation behind the layers' tensors, once."""
    seen: dict[int, Any] = {}
    for tensor in kv_caches.values():
        storage = tensor.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


class Worker:
    """One rank's connector state between ``register_kv_caches`` and ``shutdown``."""

    def __init__(self, settings: Settings, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.client: KvrouteClient | None = None
        self.endpoint: NixlEndpoint | None = None
        self.lease: SyncLease | None = None
        self.cache: RankCache | None = None
        self.pulls: Pulls | None = None
        self.prefetcher: Prefetcher | None = None
        self.holding: dict[str, float] = {}  # request id -> when its blocks are freed regardless
        self.heard: dict[str, int] = {}  # request id -> done notifications so far
        self.expected: dict[str, int] = {}
        self.heard_at: dict[str, float] = {}  # request id -> when its first done message came
        self.digest_client: KvrouteClient | None = None  # its own: used off the step's thread
        self.digests: ProducerDigests | None = None
        self.pools: PoolAccess | None = None  # None: a device it cannot reach (nothing zeroed)

    @property
    def rank(self) -> int:
        return engine_place(self.vllm_config).rank

    def register(self, kv_caches: dict[str, torch.Tensor]) -> RankCache:
        import torch

        settings = self.settings
        cache = rank_cache(
            self.vllm_config, self.kv_cache_config, kv_caches, settings.lease_seconds
        )
        rank = engine_place(self.vllm_config).rank
        engine_id = self.vllm_config.kv_transfer_config.engine_id or ""
        self.endpoint = NixlEndpoint(
            agent_name(settings.instance, engine_id, rank),
            progress_thread=settings.nixl_progress_thread,
        )
        for storage in _storages(kv_caches):  # a layer-outermost cache has one per layer
            backing = torch.empty(0, dtype=torch.int8, device=storage.device)
            backing.set_(storage, 0, (storage.nbytes(),), (1,))
            self.endpoint.register(backing)
        document = {
            **cache.document,
            **settings.registration_members(),
            "role": settings.role,
            "nixl_agent_metadata": self.endpoint.metadata,
        }
        self.client = KvrouteClient(settings.url, token=settings.token)
        try:
            self.lease = self.client.keep_lease(
                settings.deployment, settings.instance, rank, document
            )
        except KvrouteError as error:
            self.close()
            raise RegistrationRefused(error, settings.instance, rank) from error
        cache.document = document
        self.cache = cache
        log.info("kvroute: %s rank %d registered in %s as %s (%d views, %d pools)",
                 settings.instance, rank, settings.deployment, settings.role,
                 len(document["views"]), len(document["pools"]))  # fmt: skip
        parallel = self.vllm_config.parallel_config
        memory = self._memory(cache, rank)
        self.pools = None if memory is None else memory.pools
        if settings.producer:
            if memory is not None:  # the canary consumers pull when they first pair
                memory.write_canary()
            if memory is not None and settings.kv_digest_rate > 0:
                self.digests = ProducerDigests(
                    self._digest_client(),
                    memory,
                    settings.kv_digest_chunk,
                    settings.kv_digest_window_step,
                )
            return cache  # a producer holds blocks; only consumers pull
        self.prefetcher = Prefetcher(
            settings.url, settings.token, settings.deployment, settings.instance, rank
        )
        self.pulls = Pulls(
            self.prefetcher,
            self.endpoint,
            settings.deployment,
            settings.instance,
            rank,
            parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
            cache.addresses,
            cache.group_views,
            cache.state_groups,
            settings.pull_timeout_s,
            cache.mem_type,
            checks=None
            if memory is None
            else ConsumerChecks(
                self._digest_client(), memory, settings.kv_digest_chunk, settings.pull_timeout_s
            ),
            clock_skew_s=settings.clock_skew_s,
        )
        return cache

    def _memory(self, cache: RankCache, rank: int) -> RankMemory | None:
        where = (self.settings.deployment, self.settings.instance, rank)
        return RankMemory.of(cache.document, where, cache.addresses, cache.mem_type,
                             cache.group_views, cache.state_groups)  # fmt: skip

    def _digest_client(self) -> KvrouteClient:
        if self.digest_client is None:
            self.digest_client = KvrouteClient(self.settings.url, token=self.settings.token)
        return self.digest_client

    def start(self, step: StepPlan) -> None:
        now = time.monotonic()
        for request_id, timeout_s in step.sends.items():
            self.holding[request_id] = now + timeout_s
        for request_id, (groups, prompt_tokens) in step.digests.items():
            if self.digests is not None:  # the blocks are held until every consumer pulled
                self.digests.submit(request_id, groups, prompt_tokens)
        if (step.loads or step.releases) and self.pulls is None:
            raise RuntimeError("register_kv_caches was never called on this worker")
        for load in step.loads:
            assert self.pulls is not None
            self._zero_fresh(load)
            self.pulls.start(load)
        for handover in step.releases:
            assert self.pulls is not None
            self.pulls.release(handover)

    def _zero_fresh(self, load: Load) -> None:
        """Zeroes the block-group slots a load's tokens land in before the reads, where several
        KV cache groups share memory. vLLM zeroes an attention block it allocates (its CPU
        kernels read a partly written block's stale rows: NaN where another group's state lay),
        but not one allocated for a connector's load, which writes only the moved tokens' rows.
        A block id belongs to one group at a time: the whole slot is this request's."""
        if self.cache is None or not self._grouped or self.pools is None:
            return
        first = load.tokens[0] // load.block_size  # before it, a local prefix hit: kept
        fresh = {
            block
            for group, blocks in enumerate(load.block_ids)
            if group not in self.cache.state_groups
            for block in blocks[first:]
            if block != NULL_BLOCK  # the canary's, and the window's placeholder
        }
        if fresh:
            self.pools.zero(sorted(fresh))

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        received = self.pulls.poll() if self.pulls is not None else set()
        return (self._sent() or None), (received or None)

    def load_errors(self) -> set[int]:
        """The blocks of failed loads, with one KV cache group; with several, none: block ids are
        per group there, and vLLM stops on block-level failures (``failed_requests`` says)."""
        if self.pulls is None or self._grouped:
            return set()
        return set().union(*self.pulls.take_errors().values())

    def failed_requests(self) -> set[str]:
        """The failed loads by request id, with several KV cache groups (vLLM recomputes them)."""
        if self.pulls is None or not self._grouped:
            return set()
        return set(self.pulls.take_errors())

    @property
    def _grouped(self) -> bool:
        return self.cache is not None and len(self.cache.group_views) > 1

    def _sent(self) -> set[str]:
        """Held requests every consumer rank has pulled, or whose time is up."""
        if self.endpoint is None:
            return set()
        for _, message in self.endpoint.notifications():
            parsed = parse_done(message)
            if parsed is not None:
                request_id, notifiers = parsed
                self.heard[request_id] = self.heard.get(request_id, 0) + 1
                self.expected[request_id] = notifiers
                self.heard_at.setdefault(request_id, time.monotonic())
        now, sent = time.monotonic(), set()
        for request_id, deadline in list(self.holding.items()):
            pulled = self.heard.get(request_id, 0) >= self.expected.get(request_id, 1 << 30)
            if pulled or now > deadline:
                if not pulled:
                    log.warning("no consumer pulled %s in time; freeing its blocks", request_id)
                del self.holding[request_id]
                self._forget_heard(request_id)
                sent.add(request_id)
        self._forget_strays(now)
        return sent

    def _forget_heard(self, request_id: str) -> None:
        self.heard.pop(request_id, None)
        self.expected.pop(request_id, None)
        self.heard_at.pop(request_id, None)

    def _forget_strays(self, now: float) -> None:
        """Done messages for requests this rank does not hold: a consumer that read (or gave up on)
        blocks already freed on timeout. One may come before its hold starts (the hold starts at
        the next step), so each is kept for one ``send_timeout_s`` before it is dropped."""
        for request_id, heard_at in list(self.heard_at.items()):
            if request_id not in self.holding and now - heard_at > self.settings.send_timeout_s:
                self._forget_heard(request_id)

    def close(self) -> None:
        for pool in (self.digests, self.pulls.checks if self.pulls is not None else None):
            if pool is not None:
                pool.close()
        self.digest_client = _closed(self.digest_client)
        self.prefetcher = _closed(self.prefetcher)
        if self.lease is not None:
            try:
                self.lease.stop(deregister=True)
            except KvrouteError:
                log.warning("could not deregister from kvroute", exc_info=True)
            self.lease = None
        self.client = _closed(self.client)
        self.endpoint = _closed(self.endpoint)


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


def _closed(part: C | None) -> C | None:
    """Closes ``part`` when there is one; what the attribute that held it holds next (nothing)."""
    if part is not None:
        part.close()
    return None
