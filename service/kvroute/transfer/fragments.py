"""A view pair's fragments as the data plane holds them: ``(n, 3)`` int64 arrays.

Columns are ``SRC`` (offset in the sender's slot), ``DST`` (offset in the receiver's slot) and
``LENGTH``; rows are sorted by destination and read-only, so every check and the compiled copy
program read them without copying.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SRC, DST, LENGTH = 0, 1, 2  # columns of a fragment array


def fragment_array(fragments: Sequence[Sequence[int]]) -> np.ndarray:
    """``(n, 3)`` int64, sorted by destination (stable), read-only."""
    array = np.array(fragments, dtype=np.int64).reshape(-1, 3)
    array = array[np.argsort(array[:, DST], kind="stable")]
    array.setflags(write=False)
    return array
