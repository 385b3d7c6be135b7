"""Compile a view's fragments into a few strided runs, once per plan.

Plans describe copies as byte fragments, often thousands per block (NHD with mismatched heads needs
one per token). Issuing one copy per fragment is what makes naive data planes slow. Fragments of real
layouts are regular: equal lengths at arithmetic offsets (one per layer, one per token, one per
buffer). Compilation folds such progressions, level by level, into ``StridedRun``s, n-dimensional
strided boxes that one tensor view can address, so a whole block's view copies in one operation.

A run's innermost dimension is a fragment (stride 1); each outer dimension is a progression with a
positive step on both sides. Compilation is exact: the runs cover precisely the input fragments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from kvroute.transfer.fragments import DST, LENGTH, SRC


@dataclass(frozen=True, slots=True)
class StridedRun:
    """Bytes ``src_offset + sum(i_k * src_strides[k])`` -> same index on the destination side."""

    src_offset: int
    dst_offset: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def fragments(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)

    def _same_form(self, other: StridedRun) -> bool:
        return (self.shape, self.src_strides, self.dst_strides) == (
            other.shape,
            other.src_strides,
            other.dst_strides,
        )


@dataclass(frozen=True, slots=True)
class CopyProgram:
    """A view's per-block copy: its runs plus what bounds checks and dtype widening need."""

    runs: tuple[StridedRun, ...]
    fragments: int  # per block, as the plan counts them
    nbytes: int  # per block
    src_end: int  # one past the last source byte touched, relative to the slot start
    dst_end: int
    alignment: int  # gcd of every offset, step and length: the widest element that fits

    def element_offsets(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot-relative element indices (in ``width``-byte units) of every byte the runs copy."""
        src = [
            _run_elements(run.src_offset, run.shape, run.src_strides, width) for run in self.runs
        ]
        dst = [
            _run_elements(run.dst_offset, run.shape, run.dst_strides, width) for run in self.runs
        ]
        return np.concatenate(src), np.concatenate(dst)


def compile_fragments(fragments: np.ndarray) -> CopyProgram:
    """Fold (n, 3) fragments (sorted by destination offset) into strided runs."""
    runs = [
        StridedRun(int(src), int(dst), (int(length),), (1,), (1,))
        for src, dst, length in fragments.tolist()
    ]
    while True:
        folded = _fold(runs)
        if len(folded) == len(runs):
            break
        runs = folded
    # steps are differences of offsets, so the offsets and lengths alone bound the alignment
    values = [int(v) for v in np.unique(fragments)]
    return CopyProgram(
        runs=tuple(runs),
        fragments=len(fragments),
        nbytes=int(fragments[:, LENGTH].sum()),
        src_end=int((fragments[:, SRC] + fragments[:, LENGTH]).max()),
        dst_end=int((fragments[:, DST] + fragments[:, LENGTH]).max()),
        alignment=reduce(math.gcd, values, 0),
    )


def _fold(runs: list[StridedRun]) -> list[StridedRun]:
    """One level: merge maximal chains of same-form runs whose starts advance by a constant step."""
    out: list[StridedRun] = []
    i = 0
    while i < len(runs):
        head, j, step = runs[i], i + 1, None
        while j < len(runs) and runs[j]._same_form(head):
            delta = (
                runs[j].src_offset - runs[j - 1].src_offset,
                runs[j].dst_offset - runs[j - 1].dst_offset,
            )
            # torch views take no negative strides; a zero step would alias bytes
            if delta[0] <= 0 or delta[1] <= 0 or (step is not None and delta != step):
                break
            step = delta
            j += 1
        if step is None:
            out.append(head)
        else:
            out.append(
                StridedRun(
                    head.src_offset,
                    head.dst_offset,
                    (j - i, *head.shape),
                    (step[0], *head.src_strides),
                    (step[1], *head.dst_strides),
                )
            )
        i = j
    return out


def _run_elements(
    offset: int, shape: tuple[int, ...], strides: tuple[int, ...], width: int
) -> np.ndarray:
    index = np.array([offset // width], dtype=np.int64)
    for size, stride in zip(shape[:-1], strides[:-1], strict=True):
        index = (index[:, None] + np.arange(size, dtype=np.int64) * (stride // width)).reshape(-1)
    inner = np.arange(shape[-1] // width, dtype=np.int64)
    return (index[:, None] + inner).reshape(-1)
