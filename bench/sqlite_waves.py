"""What a heartbeat wave costs on SQLite, without HTTP: ``store.leases.renew_many`` on a file of
8,192 ranks, waves of 1, 4, 16 and 64 random ranks.

Per wave size: wall milliseconds per wave, the event loop thread's CPU milliseconds per wave (what
limits one server's heartbeats) and the process's CPU (the loop and aiosqlite's thread) per
heartbeat. ``--baseline OLD/service`` first measures another checkout's kvroute the same way, in a
subprocess of its own, and adds its figures and the ratios (e.g.
``git worktree add /tmp/old HEAD~1`` then ``--baseline /tmp/old/service``).

Every rank gets a registration document of ``--document-kib`` KiB of JSON (default 16, what an
80-layer model registers; 0: an empty one), stored wherever the measured tree keeps documents (the
``ranks`` row before ``rank_documents`` existed), so trees of either schema are compared fairly.

    python bench/sqlite_waves.py [--waves 1000] [--document-kib 16] [--baseline OLD/service]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from tables import figures_table

RANKS = 8192
RANKS_PER_INSTANCE = 16
WAVE_SIZES = (1, 4, 16, 64)
SERVICE = Path(__file__).resolve().parents[1] / "service"


def _document(kib: int) -> dict[str, Any]:
    """About ``kib`` KiB of JSON shaped like a registration's views: one entry per layer."""
    layers, size = [], 2
    while size < kib * 1024:
        layer = {"layer": len(layers), "offset": 1 << 20, "stride": 4096, "head_dim": 128}
        layers.append(layer)
        size += len(json.dumps(layer)) + 2
    return {"views": [{"kind": "hnd", "layers": layers}]} if layers else {}


async def _fleet(url: str, document_kib: int) -> None:
    """8,192 live ranks of one deployment, written directly (their documents are not read, but are
    where this tree keeps them)."""
    from sqlalchemy import insert

    from kvroute.store import models
    from kvroute.store.engine import create_engine
    from kvroute.store.models import DeploymentRow, InstanceRow, RankRow

    engine = create_engine(url)
    now = datetime.now(UTC)
    later = now.replace(year=now.year + 1)
    instances = RANKS // RANKS_PER_INSTANCE
    async with engine.begin() as connection:
        await connection.execute(
            insert(DeploymentRow.__table__).values(
                name="fleet", checked_at=now, revision=0, created_at=now
            )
        )
        await connection.execute(
            insert(InstanceRow.__table__),
            [
                {"deployment": "fleet", "name": f"i{index}", "created_at": now, "role": "context"}
                | {"tp_size": 16, "pp_size": 1, "cp_size": 1, "attention_dp": False, "dp_size": 1}
                for index in range(instances)
            ],
        )
        rank = {"role": "context", "generation": 1, "lease_seconds": 30}
        stamps = {"lease_expires_at": later, "registered_at": now}
        digests = {"canonical_sha256": "0" * 64, "geometry_class": "1" * 64}
        keys = [
            {"deployment": "fleet", "instance": f"i{index // RANKS_PER_INSTANCE}"}
            | {"rank": index % RANKS_PER_INSTANCE}
            for index in range(RANKS)
        ]
        document = {"document": _document(document_kib)}
        # Trees before rank_documents keep the document in the rank's row.
        separate = getattr(models, "RankDocumentRow", None)
        inline = {} if separate else document
        await connection.execute(
            insert(RankRow.__table__),
            [key | rank | stamps | digests | inline for key in keys],
        )
        if separate:
            await connection.execute(insert(separate.__table__), [key | document for key in keys])
    await engine.dispose()


async def _waves(url: str, size: int, waves: int) -> dict[str, float]:
    from kvroute.store import leases
    from kvroute.store.engine import create_engine

    engine = create_engine(url)
    keys = [
        (f"i{index // RANKS_PER_INSTANCE}", index % RANKS_PER_INSTANCE) for index in range(RANKS)
    ]
    rng = random.Random(size)
    for _ in range(20):  # the pool's connection, SQLite's page cache, the compiled statements
        await leases.renew_many(engine, "fleet", [(*rng.choice(keys), datetime.now(UTC))])
    wall, process, loop = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(waves):
        now = datetime.now(UTC)
        wave = [(instance, rank, now) for instance, rank in rng.sample(keys, size)]
        renewed = await leases.renew_many(engine, "fleet", wave)
        assert len(renewed) == size, f"{len(renewed)} of {size} renewed"
    wall, process = time.perf_counter() - wall, time.process_time() - process
    loop = time.thread_time() - loop
    await engine.dispose()
    return {
        "wall ms/wave": wall / waves * 1e3,
        "loop CPU ms/wave": loop / waves * 1e3,
        "CPU ms/heartbeat": process / (waves * size) * 1e3,
    }


def measure(waves: int, document_kib: int) -> dict[int, dict[str, float]]:
    """This process's kvroute (whatever ``PYTHONPATH`` names), every wave size."""
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for size in WAVE_SIZES:
            path = Path(workdir) / f"waves-{size}.db"
            url = f"sqlite+aiosqlite:///{path}"
            env = {**os.environ, "KVROUTE_DATABASE_URL": url}
            upgrade = [sys.executable, "-m", "kvroute", "db", "upgrade"]
            subprocess.run(upgrade, env=env, check=True, capture_output=True)
            asyncio.run(_fleet(url, document_kib))
            results[size] = asyncio.run(_waves(url, size, waves))
    return results


def _in_tree(tree: Path, waves: int, document_kib: int) -> dict[int, dict[str, float]]:
    command = [sys.executable, __file__, "--waves", str(waves), "--json"]
    command += ["--document-kib", str(document_kib)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    answer = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return {int(size): figures for size, figures in json.loads(answer.stdout).items()}


def report(results: dict[str, dict[int, dict[str, float]]], document_kib: int) -> None:
    trees = list(results)
    ratio = ["this / baseline"] if len(trees) == 2 else []
    title = f"SQLite heartbeat waves over {RANKS:,} ranks, {document_kib} KiB documents, no HTTP"
    table = figures_table(title, ("wave", "measure"), trees + ratio)
    for size in WAVE_SIZES:
        for measure in results[trees[-1]][size]:
            values = [results[tree][size][measure] for tree in trees]
            row = [str(size), measure, *(f"{value:.3f}" for value in values)]
            if len(values) == 2:
                row.append(f"{values[1] / values[0]:.2f}x")
            table.add_row(*row)
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=1000, help="waves per size")
    parser.add_argument("--baseline", type=Path, help="another checkout's service/ directory")
    parser.add_argument(
        "--document-kib", type=int, default=16, help="each rank's document, KiB of JSON"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.waves, args.document_kib)))
        return
    results = {}
    if args.baseline:
        results["baseline"] = _in_tree(args.baseline, args.waves, args.document_kib)
    results["this tree"] = _in_tree(SERVICE, args.waves, args.document_kib)
    report(results, args.document_kib)


if __name__ == "__main__":
    main()
