"""A small Nemotron-H-like hybrid for API, transfer and end-to-end tests (tests/world.py classes).

Six layers: Mamba2 layers 0, 1, 3 and 4 (8 SSM heads of 4 bytes, conv sections [x | B | C] of 16, 8
and 8 bytes in the model), attention layers 2 and 5 (4 KV heads), layer 5 with a 6-token window.
"""

from __future__ import annotations

from tests.world import ViewClass

MAMBA = frozenset({0, 1, 3, 4})
HYBRID = [
    ViewClass(("ssm",), "target", "ssm", 8, 1, 4, layers=MAMBA),
    ViewClass(("conv",), "target", "conv", 1, 1, 1, layers=MAMBA, sections=(16, 8, 8)),
    ViewClass(("key", "value"), "target", "hnd", 4, 2, 4, layers=frozenset({2})),
    ViewClass(("key", "value"), "target", "hnd", 4, 2, 4, layers=frozenset({5}), window=6),
]
