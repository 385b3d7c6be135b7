"""What a sampled KV digest costs on CPU: GB/s of ``kvroute.client.kv_digest`` against memcpy.

One rank's request of ``--tokens`` tokens (32 layers x K, V x 8 KV heads x 128 dims bf16, 16 tokens
per block: 128 KiB per token, so 8,192 tokens are 1 GiB) in shuffled blocks of a host pool, laid
out hnd, nhd, and as vLLM's CPU backend keeps it (per head K then V, K in 2 planes). Each layout is
digested (xxh3-64 per 256-token chunk of each row series, after gathering the series in logical
order); the baseline is ``numpy.copyto`` of the same number of contiguous bytes in the same run.
Last, a canary's CPU cost per path on each layout: writing the pattern into one reserved block
through the layout and checking every byte of it (the pull itself is one block of the real plan).

A GPU rank's request is digested through a stage (``client.pool_access.DevicePools``): its blocks
gathered from the device into host arrays first. ``--device`` names where the pool lives for that
line (``cpu``: a torch tensor of host memory, so the gather is a host copy; ``cuda`` on a GPU).

Then recurrent state: one request's state slot of a Mamba2 model like Nemotron-H 8B (48 Mamba2
layers, 128 SSM heads x 64 dims x 128 states bf16 = 16 KiB per head, conv sections [x | B | C] of
8192, 1024 and 1024 channels x 3 taps bf16) per rank at ``--state-tp`` 1 and 2: digested per
logical unit (``kv_state``: one xxh3-64 per SSM head and per conv section part), and the state
canary's write and check, against ``numpy.copyto`` of the slot's bytes.

    .venv/bin/python bench/digest_bench.py [--tokens 8192] [--repeat 3] [--state-tp 1,2]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from kvroute.client.integrity import check_canary, write_canary
from kvroute.client.kv_digest import kv_digest
from kvroute.client.kv_rows import RequestKv
from kvroute.client.kv_state import read_state
from kvroute.geometry import RankRegistration
from plan_bench import timings

LAYERS, HEADS, HEAD_DIM, TPB, ELEMENT = 32, 8, 128, 16, 2
LAYER_BYTES = 2 * HEADS * TPB * HEAD_DIM * ELEMENT
INTERIORS: dict[str, dict[str, Any] | None] = {
    "hnd": None,
    "nhd": None,
    "vllm-cpu": {
        "order": "head_buffer",
        "tilings": [{"planes": 2, "token_group": 1}, {"planes": 1, "token_group": 1}],
    },
}


def registration(layout: str, slots: int) -> RankRegistration:
    view: dict[str, Any] = {
        "view_id": 0,
        "pool_id": 0,
        "kind": "nhd" if layout == "nhd" else "hnd",
        "roles": ["key", "value"],
        "owner": "target",
        "num_kv_heads": HEADS,
        "total_kv_heads": HEADS,
        "buffers_per_layer": 2,
        "bytes_per_layer": LAYER_BYTES,
        "layers": [{"layer": i, "offset": i * LAYER_BYTES} for i in range(LAYERS)],
    }
    if INTERIORS[layout]:
        view["interior"] = INTERIORS[layout]
    slot = LAYERS * LAYER_BYTES
    doc = {
        "role": "context",
        "tp_size": 1,
        "tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "layers_per_stage": [LAYERS],
        "tokens_per_block": TPB,
        "attention": {"num_kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "pools": [{"pool_id": 0, "slot_bytes": slot, "slot_stride": slot, "num_slots": slots}],
        "views": [view],
    }
    return RankRegistration.from_json(doc, deployment="bench", instance="ctx", rank=0)


MAMBA_LAYERS, SSM_HEADS, SSM_HEAD_BYTES = 48, 128, 64 * 128 * ELEMENT
CONV_SECTIONS = tuple(channels * 3 * ELEMENT for channels in (8192, 1024, 1024))


def state_registration(tp: int, tp_rank: int) -> RankRegistration:
    """One Mamba2 rank at mamba TP ``tp``: an ssm and a conv view in one state pool of 2 slots."""
    ssm_bytes = SSM_HEADS // tp * SSM_HEAD_BYTES
    conv = [size // tp for size in CONV_SECTIONS]
    layer = ssm_bytes + sum(conv)
    ssm = {
        "view_id": 0,
        "pool_id": 0,
        "kind": "ssm",
        "roles": ["ssm"],
        "owner": "target",
        "buffers_per_layer": 1,
        "bytes_per_layer": ssm_bytes,
        "ssm_bytes_per_head": SSM_HEAD_BYTES,
        "layers": [{"layer": i, "offset": i * layer} for i in range(MAMBA_LAYERS)],
    }
    conv_view = {"view_id": 1, "pool_id": 0, "kind": "conv", "roles": ["conv"], "owner": "target",
                 "buffers_per_layer": 1, "bytes_per_layer": sum(conv), "conv_sections": conv,
                 "layers": [{"layer": i, "offset": i * layer + ssm_bytes}
                            for i in range(MAMBA_LAYERS)]}  # fmt: skip
    slot = MAMBA_LAYERS * layer
    doc = {
        "role": "context", "tp_size": tp, "tp_rank": tp_rank, "pp_size": 1, "pp_rank": 0,
        "layers_per_stage": [MAMBA_LAYERS], "tokens_per_block": TPB,
        "attention": {"num_kv_heads": 1, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "pools": [{"pool_id": 0, "slot_bytes": slot, "slot_stride": slot, "num_slots": 2}],
        "views": [ssm, conv_view],
    }  # fmt: skip
    return RankRegistration.from_json(doc, deployment="bench", instance="ctx", rank=tp_rank)


def state_bench(tp: int, repeat: int) -> None:
    reg = state_registration(tp, 0)
    size = reg.pools[0].slot_bytes
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 256, size=2 * size, dtype=np.uint8)
    target = np.empty(size, dtype=np.uint8)
    copy = best(lambda: np.copyto(target, pool[:size]), repeat)
    units = sum(1 for _ in read_state(reg, {0: pool}, 0))
    state, canary = (RequestKv(reg, {0: pool}, [], range(0), state_slot=s) for s in (0, 1))
    took = best(lambda: kv_digest(state), repeat)
    written = best(lambda: write_canary(canary), repeat)
    checked = best(lambda: check_canary(canary), repeat)
    assert check_canary(canary) is None
    print(
        f"state TP{tp} rank 0 {size / 2**20:5.1f} MiB {units:5d} units  memcpy "
        f"{size / copy / 1e9:5.2f} GB/s  digest {size / took / 1e9:5.2f} GB/s "
        f"({took * 1e3:6.1f} ms)  canary write {written * 1e3:6.1f} ms  check "
        f"{checked * 1e3:6.1f} ms"
    )


def staged_bench(
    pool: np.ndarray,
    slots: int,
    blocks: list[int],
    tokens: int,
    device: str,
    repeat: int,
    copy: float,
) -> None:
    """The hnd request digested through a stage of its blocks (a GPU rank's way)."""
    import torch

    from kvroute.client.pool_access import DevicePools

    pools = DevicePools({0: torch.from_numpy(pool).view(slots, -1).to(device)})
    reg = registration("hnd", slots)
    size = len(blocks) * LAYERS * LAYER_BYTES

    def through() -> object:
        staged = pools.stage(blocks)
        return kv_digest(RequestKv(reg, staged.pools, staged.blocks(blocks), range(tokens)))

    gathered = best(lambda: pools.stage(blocks), repeat)
    took = best(through, repeat)
    print(
        f"staged from {device:<4} gather {size / gathered / 1e9:6.2f} GB/s  gather + digest hnd "
        f"{size / took / 1e9:6.2f} GB/s  {took * 1e3:7.1f} ms  x{took / copy:.1f} memcpy"
    )


def best(run: Callable[[], object], repeat: int) -> float:
    return min(timings(run, repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--state-tp", default="1,2", help="mamba TPs of the state bench")
    parser.add_argument("--device", default="cpu", help="where the staged line's pool lives")
    args = parser.parse_args()
    blocks_needed = -(-args.tokens // TPB)
    slots = blocks_needed + 8
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=slots * LAYERS * LAYER_BYTES, dtype=np.uint8)
    blocks = [int(b) for b in rng.permutation(slots)[:blocks_needed]]
    size = args.tokens * LAYERS * LAYER_BYTES // TPB
    source, target = pool[:size], np.empty(size, dtype=np.uint8)
    copy = best(lambda: np.copyto(target, source), args.repeat)
    print(f"{size / 2**30:.2f} GiB per request ({args.tokens} tokens, {blocks_needed} blocks)")
    print(f"memcpy (numpy.copyto)      {size / copy / 1e9:6.2f} GB/s")
    for layout in INTERIORS:
        reg = registration(layout, slots)
        kv = RequestKv(reg, {0: pool}, blocks, range(args.tokens))
        took = best(lambda kv=kv: kv_digest(kv), args.repeat)
        print(
            f"digest {layout:<18} {size / took / 1e9:6.2f} GB/s  "
            f"{took * 1e3:7.1f} ms  x{took / copy:.1f} memcpy"
        )
    staged_bench(pool, slots, blocks, args.tokens, args.device, args.repeat, copy)
    block, tokens = [slots - 1], range(TPB)
    for layout in INTERIORS:
        reg = registration(layout, slots)
        kv = RequestKv(reg, {0: pool}, block, tokens)
        written = best(lambda kv=kv: write_canary(kv), args.repeat)
        checked = best(lambda kv=kv: check_canary(kv), args.repeat)
        assert check_canary(kv) is None
        print(
            f"canary {layout:<18} write {written * 1e3:6.1f} ms  check {checked * 1e3:6.1f} ms  "
            f"({LAYERS * LAYER_BYTES / 2**20:.0f} MiB block)"
        )
    for tp in (int(t) for t in args.state_tp.split(",") if t):
        state_bench(tp, args.repeat)


if __name__ == "__main__":
    main()
