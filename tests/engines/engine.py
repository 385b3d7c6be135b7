"""One vLLM engine's parts on CPU, as the connector tests drive them: vLLM's own ``Scheduler``
and ``Request``, one worker-side connector per rank, and KV caches filled with a known pattern.

The pattern is a function of (layer, global KV head, token position, element), never of block
ids, so a consumer checks what it pulled against the function, whatever blocks either side used.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.engines import vllm_world as world
from tests.world import true_heads

LAYERS, HEAD_SIZE, NUM_BLOCKS = 2, 32, 24
init_none_hash(sha256)


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def pattern(layer: int, heads: list[int], tokens: torch.Tensor, marker: int = 0) -> torch.Tensor:
    """[tokens, heads, K|V elements] of small integers, exact in float16."""
    head = torch.tensor(heads).view(1, -1, 1)
    element = torch.arange(2 * HEAD_SIZE).view(1, 1, -1)
    values = (layer * 131 + head * 31 + tokens.view(-1, 1, 1) * 7 + element + marker * 53) % 251
    return (values - 125).to(torch.float16)


@dataclass
class Engine:
    """An instance: one scheduler (rank 0's config) and a worker connector per TP rank."""

    scheduler: Scheduler
    workers: list[Any]
    caches: list[dict[str, torch.Tensor]]
    tp: int
    total_heads: int
    block_size: int

    @classmethod
    def start(
        cls,
        model: Path,
        *,
        role: str,
        extra: dict[str, Any],
        tp: int,
        total_heads: int,
        block_size: int,
    ) -> Engine:
        per_rank = max(1, total_heads // tp)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=per_rank, head_size=HEAD_SIZE, dtype=torch.float16
        )
        specs = {layer_name(i): spec for i in range(LAYERS)}
        workers, caches = [], []
        engine_id = str(uuid.uuid4())  # one per engine start, shared by its ranks, as in vLLM
        for rank in range(tp):
            config = world.vllm_config(
                model, role=role, extra=extra, tp_size=tp, rank=rank, block_size=block_size,
                engine_id=engine_id,
            )  # fmt: skip
            kv_cache_config = world.cache_config(config, specs, NUM_BLOCKS)
            connector = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, kv_cache_config
            )
            rank_caches = world.allocate(config, kv_cache_config)
            connector.register_kv_caches(rank_caches)
            workers.append(connector)
            caches.append(rank_caches)
            if rank == 0:
                config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
                scheduler = Scheduler(
                    vllm_config=config,
                    kv_cache_config=kv_cache_config,
                    structured_output_manager=StructuredOutputManager(config),
                    block_size=block_size,
                    log_stats=False,
                )
        return cls(scheduler, workers, caches, tp, total_heads, block_size)

    def request(self, request_id: str, tokens: list[int], params: dict | None) -> Request:
        request = Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )
        request.kv_transfer_params = params
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def step(self) -> Any:
        """One scheduler step whose connector metadata every worker starts on."""
        output = self.scheduler.schedule()
        for worker in self.workers:
            worker.bind_connector_metadata(output.kv_connector_metadata)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
        return output

    def finish_prefill(self, output: Any, request_id: str, *, kv: KVConnectorOutput | None = None):
        """The model's answer to a step that prefilled ``request_id``: one sampled token."""
        runner = ModelRunnerOutput(
            req_ids=[request_id],
            sampled_token_ids=[[7]],
            kv_connector_output=kv,
        )
        outputs = self.scheduler.update_from_output(output, runner)
        return [
            o for batch in outputs.values() for o in batch.outputs if o.request_id == request_id
        ]

    def fill(self, block_ids: list[int], positions: range, marker: int = 0) -> None:
        """Writes the pattern for token ``positions`` into the blocks holding them, every rank."""
        tokens = torch.tensor(list(positions))
        blocks = torch.tensor(block_ids)[tokens // self.block_size]
        slots = tokens % self.block_size
        for rank, rank_caches in enumerate(self.caches):
            heads = true_heads(self.total_heads, self.tp, rank)
            for index in range(LAYERS):
                rank_caches[layer_name(index)][blocks, :, slots, :] = pattern(
                    index, heads, tokens, marker
                )

    def read(self, rank: int, block_ids: list[int], positions: range) -> list[torch.Tensor]:
        tokens = torch.tensor(list(positions))
        blocks = torch.tensor(block_ids)[tokens // self.block_size]
        slots = tokens % self.block_size
        return [self.caches[rank][layer_name(i)][blocks, :, slots, :] for i in range(LAYERS)]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
