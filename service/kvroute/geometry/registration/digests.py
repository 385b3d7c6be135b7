"""What identifies a registration: its canonical JSON and the digests that key caches and plans.

Equal canonical strings (and digests) mean an identical registration document; the geometry digest
leaves out what cannot change a plan (lease, memory descriptors, endpoints). The class digest,
what peer checks read of a rank, is ``classes.class_digest``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvroute.geometry.registration.rendering import render_registration

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


# ``json.dumps(doc, sort_keys=True, separators=(",", ":"))`` without an encoder built per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def canonical_json(doc: Mapping[str, Any]) -> str:
    """Sorted keys, no spaces: equal documents give equal strings."""
    return _CANONICAL.encode(doc)


def canonical(reg: RankRegistration) -> str:
    """Canonical JSON of the registration document."""
    return canonical_json(render_registration(reg))


def canonical_digest(reg: RankRegistration) -> str:
    """sha256 of ``canonical``."""
    return hashlib.sha256(canonical(reg).encode()).hexdigest()


def geometry_digest(reg: RankRegistration) -> str:
    """sha256 of what can change a plan: the document less lease, memory and endpoints."""
    doc = {"instance": reg.instance, "rank": reg.rank}
    doc |= render_registration(reg, geometry_only=True)
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()
