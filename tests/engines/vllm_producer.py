"""Producer engines in their own process (multiprocessing "spawn"), driven over queues.

Each instance is an ``engine.Engine`` with role kv_producer: its ranks register with kvroute at
start-up, a request is prefilled by vLLM's scheduler (the model's output is one sampled token),
its blocks are filled with the pattern, and the handover (``kv_transfer_params``) goes back to the
test. The process then reports when every rank has been told the consumer pulled (the blocks are
freed), drops an instance's NIXL agents as a crashed engine would lose them, or restarts an
instance as a new engine under the same name.
"""

from __future__ import annotations

import gc
import time
import traceback
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

WAIT_S = 300.0  # the test process may take minutes (a consumer start) between commands


def serve(url: str, token: str, root: str, instances: list[dict[str, Any]], commands: Queue,
          replies: Queue) -> None:  # fmt: skip
    engines: dict[str, Any] = {}
    try:
        specs = {spec["instance"]: spec for spec in instances}
        for spec in instances:
            engines[spec["instance"]] = _engine(url, token, root, spec)
        replies.put(("ready", sorted(engines)))
        while True:
            command, *args = commands.get(timeout=WAIT_S)
            if command == "stop":
                break
            if command == "restart":
                # Killed, then started again under the same name: a new engine id and generation.
                _crash(engines[args[0]])
                for worker in engines[args[0]].workers:
                    worker.worker.lease.stop()  # a dead process renews nothing
                engines[args[0]] = _engine(url, token, root, specs[args[0]])
                replies.put(("restarted", args[0]))
                continue
            replies.put(_handle(engines, command, *args))
    except Exception:  # the test reads the failure instead of waiting out its bound
        replies.put(("error", traceback.format_exc()))
        raise
    finally:
        for engine in engines.values():
            engine.close()


def _engine(url: str, token: str, root: str, spec: dict[str, Any]) -> Any:
    from tests.engines.engine import Engine
    from tests.engines.vllm_world import model_dir

    model = model_dir(Path(root), spec["deployment"], **spec["model"])
    extra = {"url": url, "token": token, "deployment": spec["deployment"],
             "instance": spec["instance"], "send_timeout_s": WAIT_S,
             **spec.get("extra", {})}  # fmt: skip
    return Engine.start(
        model, role="kv_producer", extra=extra, tp=spec["tp"],
        total_heads=spec["heads"], block_size=spec["block_size"],
    )  # fmt: skip


def _handle(engines: dict[str, Any], command: str, *args: Any) -> tuple[Any, ...]:
    if command == "prefill":
        instance, request_id, tokens = args
        return ("params", request_id, _prefill(engines[instance], request_id, tokens))
    if command == "await_sent":
        instance, request_id = args
        return ("sent", request_id, _await_sent(engines[instance], request_id))
    if command == "flip":
        instance, request_id, where = args
        _flip(engines[instance], request_id, where)
        return ("flipped", request_id)
    if command == "flip_canary":
        instance, where = args
        _flip_cell(engines[instance], 0, where)  # vLLM's null block, where the canary lives
        return ("flipped", "canary")
    if command == "drop":
        _crash(engines[args[0]])
        return ("dropped", args[0])
    raise ValueError(command)


def _crash(engine: Any) -> None:
    for worker in engine.workers:
        # As a crashed engine: the agent and its UCX worker go away with their memory
        # registrations; kvroute still holds the rank (its lease has not lapsed).
        endpoint, worker.worker.endpoint = worker.worker.endpoint, None
        endpoint.close()
        del endpoint._agent
    gc.collect()


def _prefill(engine: Any, request_id: str, tokens: list[int]) -> dict[str, Any]:
    engine.request(request_id, tokens, {"do_remote_decode": True})
    output = engine.step()
    engine.fill(engine.block_ids(request_id), range(len(tokens)))
    [finished] = engine.finish_prefill(output, request_id)
    engine.step()  # the step after the request finished tells the workers to hold its blocks
    return finished.kv_transfer_params


def _await_sent(engine: Any, request_id: str) -> list[int]:
    """Polls every rank until it reports the request sent; answers the ranks that did."""
    sent: set[int] = set()
    deadline = time.monotonic() + 60
    while len(sent) < len(engine.workers) and time.monotonic() < deadline:
        for rank, worker in enumerate(engine.workers):
            done, _ = worker.get_finished(set())
            if done and request_id in done:
                sent.add(rank)
        time.sleep(0.01)
    return sorted(sent)


def _flip(engine: Any, request_id: str, where: tuple[int, int, int, int, int]) -> None:
    """Flips the low bit of one element of ``request_id``'s blocks on one rank, once every rank
    has stored its digest of them: a fault after the write, which only a digest can see."""
    from kvroute.client import KvrouteClient

    rank, layer, head, token, element = where
    settings = engine.workers[0].worker.settings
    deadline = time.monotonic() + 60
    with KvrouteClient(settings.url, token=settings.token) as client:
        while (
            len(client.kv_digests(settings.deployment, settings.instance, request_id)) < engine.tp
        ):
            assert time.monotonic() < deadline, f"no digests of {request_id}"
            time.sleep(0.02)
    block = engine.block_ids(request_id)[token // engine.block_size]
    _flip_cell(engine, block, (rank, layer, head, token % engine.block_size, element))


def _flip_cell(engine: Any, block: int, where: tuple[int, int, int, int, int]) -> None:
    """Flips the low bit of element ``element`` (K before V) of one token-head row of ``block``
    on one rank (``where``: rank, layer, the rank's head, token in the block, element)."""
    import torch

    from tests.engines.engine import layer_name

    rank, layer, head, token, element = where
    cell = engine.caches[rank][layer_name(layer)][block, head, token]
    cell.view(torch.int16)[element] ^= 1
