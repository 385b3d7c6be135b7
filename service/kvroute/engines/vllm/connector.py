"""``KvrouteConnector``: vLLM's KV connector API with kvroute doing the geometry.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector": "KvrouteConnector",
"kv_connector_module_path": "kvroute.engines.vllm", ...}'``. The scheduler-side instance decides
what moves (``scheduler.SchedulerSide``); each worker-side instance registers its rank and moves
bytes (``worker.Worker``). Only the consumer's pulls move data; the producer holds blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvroute.engines.vllm.params import Settings
from kvroute.engines.vllm.scheduler import SchedulerSide, StepPlan
from kvroute.engines.vllm.worker import Worker

if TYPE_CHECKING:
    import torch


def holds_back(kv_cache_config: Any) -> bool:
    """Whether a hand-over stops one token short of the prompt: with recurrent state (Mamba,
    Gated DeltaNet, lightning attention), which holds h(N) after N tokens and cannot be rewound,
    and with sliding-window or chunked-local attention, whose blocks before the next token's window
    vLLM frees (the producer before its hand-over, the consumer as it allocates a load), while
    the consumer recomputes the prompt's last token, whose window reaches one token further back.
    """
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    shrinking = (MambaSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
    return any(isinstance(group.kv_cache_spec, shrinking) for group in groups)


class KvrouteMetadata(KVConnectorMetadata):
    """One step's loads and sends, from the scheduler to every worker."""

    def __init__(self, step: StepPlan) -> None:
        self.step = step


class KvrouteConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = Settings.from_config(
            transfer.kv_role, transfer.kv_connector_extra_config or {}
        )
        self.scheduler: SchedulerSide | None = None
        self.worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = tuple(kv_cache_config.transfer_group_ids) if kv_cache_config else (0,)
            block_size = vllm_config.cache_config.block_size
            if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
                block_size = kv_cache_config.kv_cache_groups[groups[0]].kv_cache_spec.block_size
            self.scheduler = SchedulerSide(
                self.settings,
                block_size,
                groups,
                backoff=1 if holds_back(kv_cache_config) else 0,
                engine_id=transfer.engine_id or "",
            )
        else:
            self.worker = Worker(self.settings, vllm_config, kv_cache_config)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: the workers register the cache with NIXL (UCX), so each segment must be one
        physical allocation (0.32 has no such flags and never asks)."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Block-outermost (every layer of a block in one run) unless configured otherwise:
        one kvroute pool per rank and one NIXL region; vLLM drops it if a backend cannot."""
        transfer = vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config or {}) if transfer else {}
        return extra.get("kv_cache_layout", "BLHNC")

    # Scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvrouteMetadata:
        assert self.scheduler is not None
        return KvrouteMetadata(self.scheduler.take_step())

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        assert self.scheduler is not None
        return self.scheduler.group_ids

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        assert self.scheduler is not None
        return self.scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        assert self.scheduler is not None
        return self.scheduler.finished(request, block_ids)

    # Worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvrouteMetadata)
        self.worker.start(metadata.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish between steps (asynchronous), never inside a forward pass."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is pushed: the consumer pulls from the blocks the producer holds."""

    def wait_for_save(self) -> None:
        """Nothing is pushed: the consumer pulls from the blocks the producer holds."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` and, for a hybrid model, the failed loads by request id."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        assert self.worker is not None
        sending, recving = self.worker.finished()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker.failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
