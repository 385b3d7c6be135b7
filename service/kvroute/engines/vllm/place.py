"""Where a vLLM worker sits in its engine: TP and PP sizes and ranks, and vLLM's split of the
target layers over PP stages. Engines whose ranks the connector cannot describe yet (context or
data parallelism) are refused here, at start-up, before anything registers."""

from __future__ import annotations

import re
from typing import Any

from kvroute.client.pools import Parallel


def engine_place(vllm_config: Any) -> Parallel:
    """TP/PP sizes and ranks of this worker, and vLLM's PP split of the target layers. An engine
    with context parallelism is refused: its ranks hold a share of each request's tokens, which
    this connector does not describe yet, and a registration claiming every token would plan
    rows from ranks that never held them. So is a data-parallel one (``_data_parallel``)."""
    from vllm.distributed.utils import get_pp_indices

    if dp := _data_parallel(vllm_config):
        raise ValueError(
            f"data parallelism ({dp}) is not supported by kvroute's vLLM connector yet: every "
            "data-parallel engine would register the same instance's ranks, each from its own "
            "cache, and a consumer could read another engine's blocks; run one engine per instance"
        )
    parallel = vllm_config.parallel_config
    cp = {
        name: size
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
        if (size := getattr(parallel, name, 1)) > 1
    }
    if cp:
        named = ", ".join(f"{name}={size}" for name, size in cp.items())
        raise ValueError(
            f"context parallelism ({named}) is not supported by kvroute's vLLM connector yet; "
            "nothing is guessed"
        )
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, AttributeError):  # no process groups (a single-process engine)
        tp_rank, pp_rank = parallel.rank % tp, parallel.rank // tp
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    stages = tuple(end - start for start, end in (get_pp_indices(layers, p, pp) for p in range(pp)))
    return Parallel(tp, tp_rank, pp, pp_rank, stages)


def _data_parallel(vllm_config: Any) -> str:
    """What says this engine is one of several data-parallel engines ("" if nothing does). vLLM
    resets a dense model's DP engines to ``data_parallel_size`` 1 and leaves ``data_parallel_index``
    0 on the first, but gives each an ``engine_id`` ending in ``_dp{rank}``."""
    parallel = vllm_config.parallel_config
    found = []
    for name, unset in (
        ("data_parallel_size", 1),
        ("data_parallel_rank", 0),
        ("data_parallel_index", 0),  # not set on every config: vLLM fills it in late
    ):
        if (value := getattr(parallel, name, unset)) > unset:
            found.append(f"{name}={value}")
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or ""
    if re.search(r"_dp\d+$", engine_id):
        found.append(f"engine_id={engine_id!r}")
    return ", ".join(found)
