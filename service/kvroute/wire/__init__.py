"""kvroute.wire: the shapes of the REST answers, shared by the server and the client.

``models`` holds one frozen dataclass per response schema of ``api_spec/openapi.yaml``;
``codec`` turns them into JSON and back. Pure Python, no dependencies: a worker's client-only
install has it.
"""

from kvroute.wire.codec import WireError, from_json, to_json
from kvroute.wire.models import (
    TERMINAL_STATES,
    Compatibility,
    CompatibilityInstance,
    CompatibilityPair,
    Deployment,
    DeploymentSummary,
    Instance,
    InstanceSummary,
    LeaseRenewed,
    Rank,
    RankSummary,
    Registered,
    Rejection,
    TokenRange,
    TransferJob,
)

__all__ = [
    "TERMINAL_STATES",
    "Compatibility",
    "CompatibilityInstance",
    "CompatibilityPair",
    "Deployment",
    "DeploymentSummary",
    "Instance",
    "InstanceSummary",
    "LeaseRenewed",
    "Rank",
    "RankSummary",
    "Registered",
    "Rejection",
    "TokenRange",
    "TransferJob",
    "WireError",
    "from_json",
    "to_json",
]
