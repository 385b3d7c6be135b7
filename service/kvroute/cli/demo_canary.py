"""The demo's canary: before any request moves, the path from ctx0 to each gen0 rank is attested.

Each context worker writes the canary (``client.integrity``) into the blocks it keeps back at the
end of its pool, through its own layout, and for a model with recurrent state (the hybrid demo)
into the state slot just before them; one transfer job moves those blocks and that state slot with
the real plan (context blocks into larger generation blocks, the state slot pair once); each
generation worker checks every byte through its own layout, attention rows and state units alike,
and reports the path's outcome to kvroute, which then shows it in ``GET .../kv-paths``, the pairs
answer and the console. The lead process and the workers agree on those slots without talking:
both follow ``integrity.reserved_blocks`` and ``reserved_state_slot`` (the end of the pool), the
workers from their registrations, the lead from the model (``reserved``).

With context parallelism (the MLA demos) the canary is a prompt of its own from token 0: each CP
rank writes or checks the positions it holds, at its local positions (``kv_rows.held_positions``),
and the canary's block lists are the local blocks every CP rank of one TP position shares.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from kvroute.client import KvrouteClient
from kvroute.client.integrity import (
    check_canary,
    path_report,
    reserved_blocks,
    reserved_state_slot,
    write_canary,
)
from kvroute.client.kv_rows import RequestKv
from kvroute.geometry import RankRegistration, RequestBlocks, TokenRange, TokenWindow

REPLY_WAIT_S = 300.0


def canary_tokens(model: Any) -> int:
    """Tokens of the canary: whole blocks on both sides."""
    return math.lcm(model.tokens("context"), model.tokens("generation"))


def canary_blocks(model: Any, role: str) -> int:
    """Blocks of the canary on one side: the local blocks of the CP rank holding most of it."""
    tokens = canary_tokens(model)
    return model.placement(role, tokens).last_block_end(tokens, model.tokens(role))


def pool_slots(model: Any, role: str) -> int:
    """A worker's pool: the requests' ``model.slots(role)`` slots, then the ones it keeps back for
    the canary (a state slot where the model has recurrent state, then the canary's blocks)."""
    return model.slots(role) + int(model.has_state) + canary_blocks(model, role)


def reserved(model: Any, role: str) -> tuple[list[int], int | None]:
    """The canary's blocks and state slot (None: no state) on one side: what
    ``integrity.reserved_blocks`` and ``reserved_state_slot`` find from its registration."""
    end, blocks = pool_slots(model, role), canary_blocks(model, role)
    return list(range(end - blocks, end)), end - blocks - 1 if model.has_state else None


def canary_kv(spec: Any, deployment: str, document: dict[str, Any], pool: np.ndarray) -> RequestKv:
    """What a worker holds of the canary: its blocks and state slot in ``pool`` (the rank's one
    pool, flat uint8), read and written through the layout of its registration ``document``."""
    reg = RankRegistration.from_json(
        document, deployment=deployment, instance=spec.instance, rank=spec.tp_rank
    )
    tokens = range(canary_tokens(spec.model))
    blocks = reserved_blocks(reg, tokens)
    return RequestKv(reg, {0: pool}, blocks, tokens, state_slot=reserved_state_slot(reg, tokens))


def canary_command(
    spec: Any, deployment: str, pool: np.ndarray, document: dict[str, Any]
) -> tuple[Any, ...]:
    """A worker's part: the context side writes the canary, the generation side checks what it
    received and reports the path (reply: the first wrong element's description, or None)."""
    kv = canary_kv(spec, deployment, document, pool)
    if spec.role == "context":
        write_canary(kv)
        return ("canary", spec.tp_rank, None)
    started = time.perf_counter()
    failure = check_canary(kv)
    cost_ms = (time.perf_counter() - started) * 1e3
    with KvrouteClient(spec.url, token=spec.token) as client:
        report = path_report("ctx0", spec.instance, spec.tp_rank, "canary", failure, cost_ms)
        client.report_kv_path(deployment, report)
    return ("canary", spec.tp_rank, None if failure is None else failure.describe())


def canary_job(model: Any) -> RequestBlocks:
    """The canary's transfer job: its blocks, its tokens from 0 and its state slot pair."""
    (src, src_state), (dst, dst_state) = (reserved(model, r) for r in ("context", "generation"))
    tokens = canary_tokens(model)
    # From token 0 on both lists, a prompt of its own (chunked CP places tokens by its length).
    window = TokenWindow(TokenRange(0, tokens), 0, 0, tokens)
    return RequestBlocks(src, dst, window, src_state, dst_state)


def attest(
    client: KvrouteClient, workers: Any, model: Any, deployment: str
) -> dict[int, str | None]:
    """Runs the canary over the demo's path: generation rank -> its failure (None: attested)."""
    for rank in range(model.ranks("context")):
        workers.commands[("ctx0", rank)].put(("canary",))
    for _ in range(model.ranks("context")):
        workers.replies.get(timeout=REPLY_WAIT_S)
    submitted = client.submit_transfer(
        deployment,
        sender="ctx0",
        receiver="gen0",
        receiver_ranks=list(range(model.ranks("generation"))),
        blocks=canary_job(model),
    )
    status = client.wait_transfer(submitted.id, limit_s=REPLY_WAIT_S)
    if status.state != "succeeded":
        return dict.fromkeys(range(model.ranks("generation")), f"canary job {status.error}")
    for rank in range(model.ranks("generation")):
        workers.commands[("gen0", rank)].put(("canary",))
    found = [workers.replies.get(timeout=REPLY_WAIT_S) for _ in range(model.ranks("generation"))]
    return {rank: failure for _, rank, failure in found}
