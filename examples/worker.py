"""A generation worker's integration with kvroute: describe the KV cache, register, keep the lease,
fetch the plan for one sender instance.

    python examples/worker.py --url http://127.0.0.1:8080 --token $KVROUTE_WORKER_TOKEN

A real worker would hand ``plan.document`` to its data plane (kvroute's transfers, or NIXL through
``kvroute.client.nixl_transport``); this one prints who sends what.
"""

from __future__ import annotations

import argparse

import torch

from kvroute.client import KvrouteClient, KvrouteError
from kvroute.client.pools import KvLayout, Parallel, describe_tensor, rank_document
from kvroute.geometry import Kind


def worker_document(role: str, tp_size: int, tp_rank: int) -> dict[str, object]:
    """32 layers, 8 KV heads split over TP, HND [blocks, layers, 2, heads, tokens, head_dim]."""
    kv_cache = torch.zeros(64, 32, 2, 8 // tp_size, 32, 128, dtype=torch.bfloat16)
    pool = describe_tensor(kv_cache, kind=Kind.HND, total_kv_heads=8)
    target = KvLayout.from_tensor(kv_cache, kind=Kind.HND, total_kv_heads=8)
    return rank_document(
        role=role, target=target, pools=[pool], parallel=Parallel(tp_size=tp_size, tp_rank=tp_rank)
    )


def main(url: str, token: str | None, deployment: str = "example") -> int:
    with KvrouteClient(url, token=token) as client:
        # The context instance (normally registered by its own workers).
        for rank in range(4):
            client.register(deployment, "ctx0", rank, worker_document("context", 4, rank))
        # This worker: generation rank 0 of TP2; the lease is renewed in the background.
        with client.keep_lease(deployment, "gen0", 0, worker_document("generation", 2, 0)) as lease:
            print(f"registered gen0 rank 0, generation {lease.generation}")
            try:
                client.register(deployment, "gen0", 1, worker_document("generation", 2, 1))
                plan = client.get_plan(deployment, sender="ctx0", receiver="gen0", receiver_rank=0)
            except KvrouteError as error:  # a refusal names the field and both values
                print(f"refused: {error.code} {error.field} local={error.local} peer={error.peer}")
                return 1
            print(
                f"plan {plan.fingerprint[:19]}: senders {plan.sending_ranks}, "
                f"{plan.fragments_per_block} fragments and {plan.bytes_per_block} bytes per block"
            )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--token", default=None)
    arguments = parser.parse_args()
    raise SystemExit(main(arguments.url, arguments.token))
