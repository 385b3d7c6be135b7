"""The demo's canary: before any request moves, the path from ctx0 to each gen0 rank is attested.

Each context worker writes the canary (``client.integrity``) into the blocks it keeps back at the
end of its pool, through its own layout; one transfer job moves those blocks with the real plan
(16- or 4-token context blocks into 64- or 8-token generation blocks); each generation worker
checks every byte through its own layout and reports the path's outcome to kvroute, which then
shows it in ``GET .../kv-paths``, the pairs answer and the console.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from kvroute.client import KvrouteClient
from kvroute.client.integrity import check_canary, path_report, reserved_blocks, write_canary
from kvroute.client.kv_rows import RequestKv
from kvroute.geometry import RankRegistration, RequestBlocks, TokenRange, TokenWindow

REPLY_WAIT_S = 300.0


def canary_tokens(model: Any) -> int:
    """Tokens of the canary: whole blocks on both sides."""
    return math.lcm(model.tokens("context"), model.tokens("generation"))


def canary_slots(model: Any, role: str) -> int:
    """Blocks a worker keeps back for the canary, after the prompt's."""
    return canary_tokens(model) // model.tokens(role)


def canary_command(spec: Any, pool: np.ndarray, document: dict[str, Any]) -> tuple[Any, ...]:
    """A worker's part: the context side writes the canary, the generation side checks what it
    received and reports the path (reply: the first wrong element's description, or None)."""
    reg = RankRegistration.from_json(
        document, deployment="demo", instance=spec.instance, rank=spec.tp_rank
    )
    tokens = range(canary_tokens(spec.model))
    blocks = reserved_blocks(reg, tokens)
    if spec.role == "context":
        write_canary(RequestKv(reg, {0: pool}, blocks, tokens))
        return ("canary", spec.tp_rank, None)
    started = time.perf_counter()
    failure = check_canary(RequestKv(reg, {0: pool}, blocks, tokens))
    cost_ms = (time.perf_counter() - started) * 1e3
    with KvrouteClient(spec.url, token=spec.token) as client:
        report = path_report("ctx0", spec.instance, spec.tp_rank, "canary", failure, cost_ms)
        client.report_kv_path("demo", report)
    return ("canary", spec.tp_rank, None if failure is None else failure.describe())


def attest(client: KvrouteClient, workers: Any, model: Any) -> dict[int, str | None]:
    """Runs the canary over the demo's path: generation rank -> its failure (None: attested)."""
    for rank in range(model.ranks("context")):
        workers.commands[("ctx0", rank)].put(("canary",))
    for _ in range(model.ranks("context")):
        workers.replies.get(timeout=REPLY_WAIT_S)
    tokens = canary_tokens(model)
    ends = {
        role: model.slots(role) + canary_slots(model, role) for role in ("context", "generation")
    }
    submitted = client.submit_transfer(
        "demo",
        sender="ctx0",
        receiver="gen0",
        receiver_ranks=list(range(model.ranks("generation"))),
        blocks=RequestBlocks(
            list(range(model.slots("context"), ends["context"])),
            list(range(model.slots("generation"), ends["generation"])),
            TokenWindow(TokenRange(0, tokens)),
        ),
    )
    status = client.wait_transfer(submitted.id, limit_s=REPLY_WAIT_S)
    if status.state != "succeeded":
        return dict.fromkeys(range(model.ranks("generation")), f"canary job {status.error}")
    for rank in range(model.ranks("generation")):
        workers.commands[("gen0", rank)].put(("canary",))
    found = [workers.replies.get(timeout=REPLY_WAIT_S) for _ in range(model.ranks("generation"))]
    return {rank: failure for _, rank, failure in found}
