"""``kvroute demo``: a whole disaggregated deployment on this machine, checked byte for byte.

Starts an embedded kvroute (SQLite in a temp directory, 127.0.0.1, a free port, random tokens),
spawns context TP4 and generation TP2 worker processes with shared-memory pools (the generation
side cutting tokens into larger blocks), registers them through ``kvroute.client``, shows a refused
instance with its reason, fetches plans, attests the path with a canary (``demo_canary``: attention
KV, and recurrent state for hybrid models; the MLA demos say why they run none), runs token-range
jobs on kvroute's worker pool (as a receiver holding a cached prefix would: ranges that start and
end mid-block), verifies every byte in the receivers and prints a summary. Exits 1 if any byte is
wrong, a canary failed or a job failed.
``--model llama`` (``demo_workers``) is a dense model with an Eagle draft whose prompt moves in
chunks; ``--model hybrid`` (``demo_hybrid``) a Nemotron-H-like model whose Mamba2 state and
attention KV share one pool, one job per request with its state slots; ``--model mla-cp``
(``demo_mla``) a DeepSeek-like MLA model, context TP4 to generation TP1 x CP4 (decode context
parallel, interleave 1) with other block sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import secrets
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvroute.cli import demo_canary
from kvroute.cli.common import CommandError
from kvroute.client import (
    KvrouteClient,
    KvrouteError,
    RequestBlocks,
    TokenRange,
    TokenWindow,
    TransferStatus,
)

REPLY_WAIT_S = 120.0
console = Console(highlight=False, width=110)


@contextmanager
def embedded_kvroute(directory: Path) -> Iterator[tuple[str, str, str]]:
    """kvroute on its own event-loop thread; yields (url, worker token, admin token)."""
    from aiohttp import web

    from kvroute.api import create_app
    from kvroute.cli.serve import prepare_schema
    from kvroute.settings import Settings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    worker, admin = secrets.token_hex(16), secrets.token_hex(16)
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{directory / 'kvroute.db'}",
        host="127.0.0.1",
        port=port,
        worker_token=worker,
        admin_token=admin,
        log_level="WARNING",
        shutdown_timeout_seconds=5.0,
    )
    prepare_schema(settings)
    loop = asyncio.new_event_loop()
    # Workers deregister before the server stops, so nothing is in flight to wait for.
    runner = web.AppRunner(create_app(settings), access_log=None, shutdown_timeout=2.0)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="kvroute-embedded", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", worker, admin
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


class Workers:
    """The worker processes and their command/reply queues; ``demo`` is the model's worker module
    (``demo_workers`` or ``demo_hybrid``)."""

    def __init__(self, url: str, token: str, model: Any, demo: ModuleType) -> None:
        # Workers fork from one server process that imported torch once, instead of each spawned
        # worker importing it again (2 s of CPU each); the server runs no torch work itself.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([demo.__name__])
        self.replies: Any = context.Queue()
        self.commands: dict[tuple[str, int], Any] = {}
        self.processes: list[Any] = []
        tag = uuid.uuid4().hex[:8]
        for role, instance in (("context", "ctx0"), ("generation", "gen0")):
            for rank in range(model.ranks(role)):
                spec = demo.WorkerSpec(
                    url,
                    token,
                    role,
                    instance,
                    model.tp(role),
                    rank,
                    model,
                    f"kvroute-demo-{tag}-{instance}-{rank}",
                )
                queue = context.Queue()
                process = context.Process(
                    target=demo.serve, args=(spec, queue, self.replies), daemon=True
                )
                self.commands[(instance, rank)] = queue
                self.processes.append(process)

    def start(self, progress: Progress) -> None:
        task = progress.add_task(
            "starting workers, filling and registering pools", total=len(self.processes)
        )
        for process in self.processes:
            process.start()
        for _ in self.processes:
            self.replies.get(timeout=REPLY_WAIT_S)
            progress.advance(task)

    def verify(
        self, requests: list[dict[str, Any]], ranks: int, progress: Progress
    ) -> dict[str, int]:
        task = progress.add_task("verifying every received byte", total=ranks)
        for rank in range(ranks):
            self.commands[("gen0", rank)].put(("verify", requests))
        total = {"checked": 0, "wrong": 0}
        for _ in range(ranks):
            _, _, counts = self.replies.get(timeout=REPLY_WAIT_S)
            total = {key: total[key] + counts[key] for key in total}
            progress.advance(task)
        return total

    def stop(self) -> None:
        for queue in self.commands.values():
            queue.put(("stop",))
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()


def refuse_incompatible(client: KvrouteClient, demo: ModuleType, model: Any) -> KvrouteError | None:
    """The model's incompatible generation instance: kvroute must refuse it."""
    try:
        client.register(demo.DEPLOYMENT, "gen-bad", 0, demo.incompatible_document(model))
    except KvrouteError as error:
        return error
    return None


def run_jobs(
    client: KvrouteClient,
    demo: ModuleType,
    model: Any,
    requests: list[dict[str, Any]],
    progress: Progress,
) -> list[TransferStatus]:
    """One transfer job per request (a token range with the blocks holding it, and for hybrid
    models its state slots) through kvroute's worker pool, for every generation rank."""
    task = progress.add_task(
        f"{len(requests)} transfer jobs on kvroute's worker pool", total=len(requests)
    )
    statuses = []
    for request in requests:
        submitted = client.submit_transfer(
            demo.DEPLOYMENT,
            sender="ctx0",
            receiver="gen0",
            receiver_ranks=list(range(model.ranks("generation"))),
            blocks=RequestBlocks(
                request["src_blocks"],
                request["dst_blocks"],
                TokenWindow(
                    TokenRange(*request["tokens"]),
                    request.get("src_first_token"),
                    request.get("dst_first_token"),
                    request.get("prompt_tokens"),
                ),
                request.get("src_state_slot"),
                request.get("dst_state_slot"),
            ),
        )
        statuses.append(client.wait_transfer(submitted.id, limit_s=REPLY_WAIT_S))
        progress.advance(task)
    return statuses


def plan_table(plans: list[Any], model: Any) -> Table:
    table = Table(
        title=f"plans (context ctx0 {model.label('context')}, {model.tokens('context')} tokens/block "
        f"-> generation gen0 {model.label('generation')}, {model.tokens('generation')} tokens/block)"
    )
    state = any(plan.state_bytes for plan in plans)
    columns = ["rank", "hears from", "writers", "frags/block", "bytes/block"]
    columns += ["state bytes/request", "state frags"] if state else []
    for column in (*columns, "bounce-safe"):
        table.add_column(column, justify="right")
    for plan in plans:
        cells = [
            str(plan.receiver_rank),
            ", ".join(str(peer.rank) for peer in plan.plan.peers),
            ", ".join(str(r) for r in plan.sending_ranks),
            str(plan.fragments_per_block),
            f"{plan.bytes_per_block:,}",
        ]
        cells += [f"{plan.state_bytes:,}", str(plan.state_fragments)] if state else []
        table.add_row(*cells, str(plan.fanin_bounce_safe))
    return table


def summary_table(
    plans: list[Any],
    statuses: list[TransferStatus],
    requests: list[dict[str, Any]],
    verified: dict[str, int],
) -> Table:
    table = Table(title="summary")
    for column in ("job", "state", "tokens", "fragments", "bytes", "seconds", "GB/s"):
        table.add_column(column, justify="right")
    for status, request in zip(statuses, requests, strict=True):
        rate = status.gigabytes_per_second
        table.add_row(
            status.id[:8],
            status.state,
            "[{}, {})".format(*request["tokens"]),
            f"{status.fragments:,}",
            f"{status.bytes:,}",
            f"{status.duration_seconds or 0:.3f}",
            f"{rate:.2f}" if rate is not None else "-",
        )
    moved = sum(status.bytes for status in statuses)
    table.add_section()
    table.add_row(
        "plans",
        str(len(plans)),
        "",
        f"{sum(p.fragments_per_block for p in plans):,}/block",
        f"{moved:,}",
        "",
        "",
    )
    ok = verified["wrong"] == 0
    table.add_row(
        "verified",
        "[green]ok[/]" if ok else "[red]WRONG[/]",
        "",
        "",
        f"{verified['checked']:,} checked",
        f"{verified['wrong']:,} wrong",
        "",
    )
    return table


def _model(args: argparse.Namespace) -> tuple[ModuleType, Any, list[dict[str, Any]]]:
    """The worker module, the model and its transfer requests; torch is imported only here."""
    try:
        from kvroute.cli import demo_hybrid, demo_mla, demo_workers
    except ModuleNotFoundError as missing:
        if missing.name != "torch":
            raise
        raise CommandError(
            "kvroute demo moves bytes with torch, which is not installed: "
            "pip install 'kvroute[server,transfer]'"
        ) from None
    if args.model in ("mla-cp", "mla-cp-zigzag"):
        zigzag = args.model == "mla-cp-zigzag"
        small, full = (
            (demo_mla.SMALL_ZIGZAG, demo_mla.FULL_ZIGZAG)
            if zigzag
            else (demo_mla.SMALL, demo_mla.FULL)
        )
        mla = replace(small if args.small else full, jobs=args.jobs)
        return demo_mla, mla, demo_mla.requests(mla, args.jobs)
    if args.model == "hybrid":
        base = demo_hybrid.SMALL if args.small else demo_hybrid.FULL
        hybrid = replace(base, jobs=args.jobs)
        return demo_hybrid, hybrid, hybrid.requests()
    model = demo_workers.SMALL if args.small else demo_workers.FULL
    return demo_workers, model, demo_workers.requests(model, args.jobs)


def _attested(client: KvrouteClient, workers: Workers, demo: ModuleType, model: Any) -> bool:
    """The canary over ctx0 -> every gen0 rank, printed; False when a path failed."""
    failures = demo_canary.attest(client, workers, model, demo.DEPLOYMENT)
    for rank, failure in sorted(failures.items()):
        if failure is None:
            console.print(f"canary ctx0 -> gen0 rank {rank}: attested")
        else:
            console.print(f"[red]canary ctx0 -> gen0 rank {rank}: failed at {failure}[/]")
    return not any(failures.values())


def _print_refusal(refusal: KvrouteError) -> None:
    console.print(
        f"refused gen-bad: {refusal.status} {refusal.code} field={refusal.field} "
        f"local={refusal.local} peer={refusal.peer} ({refusal.peer_instance} rank {refusal.peer_rank})"
    )


def run(args: argparse.Namespace) -> int:
    demo, model, requests = _model(args)
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-demo-") as directory,
        embedded_kvroute(Path(directory)) as (url, worker_token, admin_token),
    ):
        console.print(f"kvroute at {url} (SQLite in {directory})")
        workers = Workers(url, worker_token, model, demo)
        try:
            with Progress(console=console, transient=False) as progress:
                workers.start(progress)
            with KvrouteClient(url, token=admin_token) as admin:
                for instance in admin.instances(demo.DEPLOYMENT):
                    console.print(
                        f"registered {instance.name}: {instance.role}, TP{instance.tp_size}"
                        + (f" x CP{instance.cp_size}" if instance.cp_size > 1 else "")
                        + f", {instance.live_ranks} live ranks"
                    )
                refusal = refuse_incompatible(admin, demo, model)
                if refusal is None:
                    console.print("[red]an incompatible instance was accepted[/]")
                    return 1
                _print_refusal(refusal)
                # A sender holding prefill CP chunks is planned for the requests' prompt length.
                prompt = requests[0].get("prompt_tokens")
                plans = admin.get_plans(
                    demo.DEPLOYMENT, sender="ctx0", receiver="gen0", prompt_tokens=prompt
                )
                console.print(plan_table(plans, model))
                # The path is attested with a canary before any request moves.
                if not _attested(admin, workers, demo, model):
                    return 1
                with Progress(console=console) as progress:
                    statuses = run_jobs(admin, demo, model, requests, progress)
                    verified = workers.verify(requests, model.ranks("generation"), progress)
            console.print(summary_table(plans, statuses, requests, verified))
        finally:
            workers.stop()
    failed = [status for status in statuses if status.state != "succeeded"]
    for status in failed:
        console.print(f"[red]job {status.id} {status.state}: {status.error}[/]")
    return 0 if verified["wrong"] == 0 and not failed else 1


def add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo", help="run a whole deployment locally and verify every byte"
    )
    parser.add_argument(
        "--model",
        choices=["llama", "hybrid", "mla-cp", "mla-cp-zigzag"],
        default="llama",
        help="llama: a Llama-3-8B-like model with an Eagle draft; hybrid: a Nemotron-H-like model "
        "(Mamba2 state and attention KV in one pool per rank); mla-cp: a DeepSeek-like MLA model, "
        "context TP4 -> generation TP1 x CP4 (decode context parallel, interleave 1); "
        "mla-cp-zigzag: the same from context TP2 x CP2 holding zig-zag prefill chunks",
    )
    parser.add_argument("--small", action="store_true", help="a few layers with small heads")
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        choices=range(1, 7),
        metavar="N",
        help="transfer jobs to run (1-6, default 2)",
    )
    parser.set_defaults(run=run)
