"""A worker host installs kvroute's base requirements only (the ``client`` set): nothing of the server.

The worker runs in its own interpreter whose import system cannot find any top-level module outside
the standard library, kvroute itself and the distributions that the base requirements pull in
(their transitive closure, read from the installed metadata). It registers ranks against a live
kvroute and reads a plan and its NIXL descriptors: what a worker does, with what it would have.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from kvroute.cli import SERVER_MODULES
from tests.client.live import WORKER_TOKEN, LiveServer
from tests.documents import rank_document

WORKER = r"""
import importlib.machinery, json, sys

allowed = set(json.loads(sys.argv[1]))

class ClientOnly(importlib.machinery.PathFinder):
    # As if absent: find_spec answers None, so optional probes see nothing and imports fail.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names:
            return super().find_spec(name, path, target)
        return None

sys.meta_path[:] = [
    ClientOnly if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path
]

from kvroute.client import KvrouteClient, RequestBlocks
from kvroute.client.nixl_descs import PoolAddress, plan_descriptors

url, token, documents = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
with KvrouteClient(url, token=token) as client:
    for instance, rank, document in documents:
        client.register("llama", instance, rank, document)
    plan = client.get_plan("llama", sender="ctx0", receiver="gen0", receiver_rank=0)

def addresses(document, base):
    return {
        pool["pool_id"]: PoolAddress(base, pool.get("slot_stride", pool["slot_bytes"]), pool["num_slots"])
        for pool in document["pools"]
    }

senders = {rank: addresses(doc, 1 << 32) for name, rank, doc in documents if name == "ctx0"}
receiver = addresses(documents[-1][2], 0)
transfer = plan_descriptors(
    plan.plan, receiver_pools=receiver, sender_pools=senders, blocks=RequestBlocks([0, 1], [2, 3])
)
server = sorted(name for name in sys.modules if name.partition(".")[0] in set(sys.argv[5:]))
print(json.dumps({
    "writers": list(plan.sending_ranks),
    "bytes": transfer.bytes,
    "expected": 2 * plan.document["bytes_per_block"],
    "server": server,
}))
"""


def _requirement_closure(roots: list[str]) -> set[str]:
    """Distributions the roots need, transitively, without extras (what pip would install)."""
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return seen


def _top_level(distribution: str) -> set[str]:
    files = metadata.distribution(distribution).files or []
    names = {file.parts[0].removesuffix(".py") for file in files if file.parts}
    return {name for name in names if name.isidentifier() and not name.startswith("_")}


def _base_requirements() -> list[str]:
    texts = metadata.requires("kvroute") or []
    return [Requirement(t).name for t in texts if Requirement(t).marker is None]


def _server_extra_modules() -> set[str]:
    texts = metadata.requires("kvroute") or []
    server = [Requirement(t) for t in texts if Requirement(t).marker is not None]
    names = [r.name for r in server if r.marker and r.marker.evaluate({"extra": "server"})]
    return set().union(*(_top_level(name) for name in names))


def test_cli_names_every_server_module_for_its_install_hint() -> None:
    # A missing server library makes `kvroute` print the install line instead of a traceback.
    assert _server_extra_modules() <= SERVER_MODULES


def test_a_worker_with_only_the_client_requirements(live_server: LiveServer) -> None:
    closure = _requirement_closure(_base_requirements())
    assert "sqlalchemy" not in closure
    assert "torch" not in closure
    allowed = {"kvroute"}.union(*(_top_level(name) for name in closure))
    documents = [("ctx0", rank, rank_document(tp_size=2, tp_rank=rank)) for rank in range(2)] + [
        ("gen0", 0, rank_document(role="generation"))
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            WORKER,
            json.dumps(sorted(allowed)),
            live_server.url,
            WORKER_TOKEN,
            json.dumps(documents),
            *sorted(SERVER_MODULES | {"torch"}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["writers"] == [0, 1]
    assert answer["bytes"] == answer["expected"] > 0
    assert answer["server"] == []
