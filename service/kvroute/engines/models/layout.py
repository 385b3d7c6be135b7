"""An instance's parallel layout as pre-flight takes it: ``tp=8,pp=2,tpb=32`` and friends.

Keys: ``tp``, ``pp``, ``split`` (layers per PP stage, ``31/30``; default vLLM's split: equal
stages, the remainder given to the stages before the last), ``dp`` (attention-DP groups; KV heads
are split over ``tp / dp``), ``tpb`` (tokens per block), ``dtype`` (KV cache: ``auto`` is the
model's, ``fp8`` is ``float8_e4m3fn``, or any kvroute dtype of whole bytes), ``state_dtype`` (Mamba
state; default the model's), ``mtp`` (multi-token-prediction layers held as draft layers) and
``blocks`` (slots per pool; geometry checks never read it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvroute.geometry import DTYPE_BITS

DTYPE_ALIASES: Mapping[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
INT_KEYS = ("tp", "pp", "dp", "tpb", "mtp", "blocks")
MAX_PARALLEL = 1024  # limits.py's bound on TP, PP and DP
DEFAULT_BLOCKS = 1024


class LayoutError(ValueError):
    """A layout string or value that is not a layout (the user's typo, not a refusal)."""


@dataclass(frozen=True, slots=True)
class Layout:
    role: str = "context"
    tp: int = 1
    pp: int = 1
    split: tuple[int, ...] | None = None
    dp: int = 1  # attention-DP groups; 1 is off
    tpb: int = 16
    dtype: str = "auto"
    state_dtype: str = "auto"
    mtp: int = 0
    blocks: int = DEFAULT_BLOCKS

    def __post_init__(self) -> None:
        if self.role not in ("context", "generation"):
            raise LayoutError(f"role must be context or generation, not {self.role!r}")
        for key in ("tp", "pp", "dp", "tpb", "blocks"):
            value = getattr(self, key)
            if not 1 <= value <= (MAX_PARALLEL if key in ("tp", "pp", "dp") else 1 << 20):
                raise LayoutError(f"{key}={value} is out of range")
        if self.mtp < 0:
            raise LayoutError(f"mtp={self.mtp} is negative")
        if self.tp * self.pp > MAX_PARALLEL:
            raise LayoutError(
                f"tp x pp = {self.tp * self.pp} ranks; an instance has at most {MAX_PARALLEL}"
            )
        if self.tp % self.dp:
            raise LayoutError(f"dp={self.dp} attention-DP groups do not divide tp={self.tp}")
        if self.split is not None and len(self.split) != self.pp:
            raise LayoutError(f"split has {len(self.split)} stages, pp is {self.pp}")
        kv_dtype(self.dtype, "bfloat16")
        kv_dtype(self.state_dtype, "bfloat16")

    @property
    def attention_dp(self) -> bool:
        return self.dp > 1

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    def stages(self, num_layers: int) -> tuple[int, ...]:
        """Layers per PP stage: the given split (it must cover the model) or vLLM's default."""
        if self.split is not None:
            if sum(self.split) != num_layers:
                raise LayoutError(
                    f"split {'/'.join(map(str, self.split))} covers {sum(self.split)} layers; "
                    f"the model has {num_layers}"
                )
            return self.split
        if self.pp > num_layers:
            raise LayoutError(f"pp={self.pp} stages for {num_layers} layers")
        stages = [num_layers // self.pp] * self.pp
        for index in range(num_layers % self.pp):
            stages[-2 - index] += 1
        return tuple(stages)

    def with_role(self, role: str) -> Layout:
        return replace(self, role=role)


def kv_dtype(name: str, model: str) -> str:
    """A kvroute dtype name for ``name`` (``auto`` is the model's dtype)."""
    resolved = model if name == "auto" else DTYPE_ALIASES.get(name, name)
    if DTYPE_BITS.get(resolved, 0) < 8:
        known = ", ".join(["auto", *DTYPE_ALIASES, *(n for n, b in DTYPE_BITS.items() if b >= 8)])
        raise LayoutError(f"dtype {name!r} is not a whole-byte cache dtype; known: {known}")
    return resolved


def parse_layout(text: str, role: str) -> Layout:
    """``tp=8,pp=2,split=31/30,dp=8,tpb=32,dtype=fp8,mtp=1`` as a Layout of ``role``."""
    values: dict[str, Any] = {"role": role}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise LayoutError(f"{item!r} is not key=value")
        if key in INT_KEYS:
            values[key] = _integer(key, value)
        elif key == "split":
            values["split"] = tuple(_integer(key, part) for part in value.split("/"))
        elif key in ("dtype", "state_dtype"):
            values[key] = value
        else:
            raise LayoutError(
                f"unknown layout key {key!r}; known: {', '.join(INT_KEYS)}, split, dtype, state_dtype"
            )
    return Layout(**values)


def _integer(key: str, value: str) -> int:
    if not value.isascii() or not value.isdigit():
        raise LayoutError(f"{key}={value!r} is not a whole number")
    return int(value)
