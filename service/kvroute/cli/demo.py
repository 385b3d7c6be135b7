"""``kvroute demo``: a whole disaggregated deployment on this machine, checked byte for byte.

Starts an embedded kvroute (SQLite in a temp directory, 127.0.0.1, a free port, random tokens),
spawns context TP4 and generation TP2 worker processes with shared-memory pools, registers them
through ``kvroute.client``, shows a refused instance with its reason, fetches plans, runs transfer
jobs on kvroute's worker pool, verifies every byte in the receivers and prints a summary.
Exits 1 if any byte is wrong or a job failed.
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
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvroute.client import KvrouteClient, KvrouteError, TransferStatus

if TYPE_CHECKING:
    from kvroute.cli import demo_workers as demo

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
    """The worker processes and their command/reply queues."""

    def __init__(self, url: str, token: str, model: demo.Model) -> None:
        from kvroute.cli import demo_workers as demo

        context = multiprocessing.get_context("spawn")
        self.replies: Any = context.Queue()
        self.commands: dict[tuple[str, int], Any] = {}
        self.processes: list[Any] = []
        tag = uuid.uuid4().hex[:8]
        for role, instance, tp in (
            ("context", "ctx0", model.context_tp),
            ("generation", "gen0", model.generation_tp),
        ):
            for rank in range(tp):
                spec = demo.WorkerSpec(
                    url,
                    token,
                    role,
                    instance,
                    tp,
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
        self, pairs: list[tuple[int, int]], ranks: int, progress: Progress
    ) -> dict[str, int]:
        task = progress.add_task("verifying every received byte", total=ranks)
        for rank in range(ranks):
            self.commands[("gen0", rank)].put(("verify", pairs))
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


def refuse_incompatible(client: KvrouteClient, model: demo.Model) -> KvrouteError | None:
    """A generation instance whose blocks hold half the tokens: kvroute must refuse it."""
    from kvroute.cli import demo_workers as demo
    from kvroute.client.pools import Parallel, SharedKvPool, rank_document

    halved = [
        replace(layout, tokens_per_block=layout.tokens_per_block // 2)
        for layout in model.layouts(model.generation_tp)
    ]
    pool = replace(SharedKvPool.carve(halved, 1).describe(), num_slots=4)
    document = rank_document(
        role="generation",
        target=halved[0],
        pools=[pool],
        num_draft_layers=1,
        parallel=Parallel(tp_size=model.generation_tp),
    )
    try:
        client.register(demo.DEPLOYMENT, "gen-bad", 0, document)
    except KvrouteError as error:
        return error
    return None


def run_jobs(
    client: KvrouteClient, model: demo.Model, jobs: int, progress: Progress
) -> tuple[list[TransferStatus], list[tuple[int, int]]]:
    """Moves disjoint block batches (reversed order on the receiver) through kvroute's worker pool."""
    from kvroute.cli import demo_workers as demo

    per_job = model.num_slots // jobs
    task = progress.add_task(f"{jobs} transfer jobs on kvroute's worker pool", total=jobs)
    statuses, pairs = [], []
    for job in range(jobs):
        src = list(range(job * per_job, (job + 1) * per_job))
        dst = [model.num_slots - 1 - block for block in src]
        submitted = client.submit_transfer(
            demo.DEPLOYMENT,
            sender="ctx0",
            receiver="gen0",
            receiver_ranks=list(range(model.generation_tp)),
            src_blocks=src,
            dst_blocks=dst,
        )
        statuses.append(client.wait_transfer(submitted.id, limit_s=REPLY_WAIT_S))
        pairs += list(zip(src, dst, strict=True))
        progress.advance(task)
    return statuses, pairs


def plan_table(plans: list[Any]) -> Table:
    table = Table(title="plans (context ctx0 TP4 -> generation gen0 TP2)")
    for column in ("rank", "hears from", "writers", "frags/block", "bytes/block", "bounce-safe"):
        table.add_column(column, justify="right")
    for plan in plans:
        peers = plan.document["peers"]
        table.add_row(
            str(plan.receiver_rank),
            ", ".join(str(p["rank"]) for p in peers),
            ", ".join(str(r) for r in plan.sending_ranks),
            str(plan.fragments_per_block),
            f"{plan.bytes_per_block:,}",
            str(plan.fanin_bounce_safe),
        )
    return table


def summary_table(
    plans: list[Any], statuses: list[TransferStatus], verified: dict[str, int]
) -> Table:
    table = Table(title="summary")
    for column in ("job", "state", "blocks", "fragments", "bytes", "seconds", "GB/s"):
        table.add_column(column, justify="right")
    for status in statuses:
        rate = status.gigabytes_per_second
        table.add_row(
            status.id[:8],
            status.state,
            str(status.document.get("blocks", "")),
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


def run(args: argparse.Namespace) -> int:
    from kvroute.cli import demo_workers as demo  # torch is imported only when the demo runs

    model = demo.SMALL if args.small else demo.FULL
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-demo-") as directory,
        embedded_kvroute(Path(directory)) as (url, worker_token, admin_token),
    ):
        console.print(f"kvroute at {url} (SQLite in {directory})")
        workers = Workers(url, worker_token, model)
        try:
            with Progress(console=console, transient=False) as progress:
                workers.start(progress)
            with KvrouteClient(url, token=admin_token) as admin:
                for instance in admin.instances(demo.DEPLOYMENT):
                    console.print(
                        f"registered {instance.name}: {instance.role}, TP{instance.tp_size}, {instance.live_ranks} live ranks"
                    )
                refusal = refuse_incompatible(admin, model)
                if refusal is None:
                    console.print("[red]an incompatible instance was accepted[/]")
                    return 1
                console.print(
                    f"refused gen-bad: {refusal.status} {refusal.code} field={refusal.field} "
                    f"local={refusal.local} peer={refusal.peer} ({refusal.peer_instance} rank {refusal.peer_rank})"
                )
                plans = admin.get_plans(demo.DEPLOYMENT, sender="ctx0", receiver="gen0")
                console.print(plan_table(plans))
                with Progress(console=console) as progress:
                    statuses, pairs = run_jobs(admin, model, args.jobs, progress)
                    verified = workers.verify(pairs, model.generation_tp, progress)
            console.print(summary_table(plans, statuses, verified))
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
    parser.add_argument("--small", action="store_true", help="a 4-layer model instead of 32 layers")
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        choices=range(1, 7),
        metavar="N",
        help="transfer jobs to run (1-6, default 2)",
    )
    parser.set_defaults(run=run)
