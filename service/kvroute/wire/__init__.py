"""kvroute.wire: the shapes of the REST answers, shared by the server and the client.

``models`` holds one frozen dataclass per response schema of ``api_spec/openapi.yaml``;
``codec`` turns them into JSON and back. Pure Python, no dependencies: a worker's client-only
install has it.
"""

from kvroute.wire.codec import WireError, from_json, to_json
from kvroute.wire.kv_paths import PATH_STATES, KvPath, KvPaths
from kvroute.wire.models import (
    OPTION_NAMES,
    TERMINAL_STATES,
    Compatibility,
    CompatibilityInstance,
    CompatibilityPair,
    Deployment,
    DeploymentSummary,
    EngineLease,
    Event,
    Instance,
    InstanceSummary,
    LeasedRank,
    LeaseRenewed,
    Rank,
    RankSummary,
    Registered,
    Rejection,
    TokenRange,
    TransferJob,
    TransferOptions,
    TransferRequest,
)
from kvroute.wire.pairs import GenerationPairs, PairChoice, PairExclusion, Pairing, Pairs

__all__ = [
    "OPTION_NAMES",
    "PATH_STATES",
    "TERMINAL_STATES",
    "Compatibility",
    "CompatibilityInstance",
    "CompatibilityPair",
    "Deployment",
    "DeploymentSummary",
    "EngineLease",
    "Event",
    "GenerationPairs",
    "Instance",
    "InstanceSummary",
    "KvPath",
    "KvPaths",
    "LeaseRenewed",
    "LeasedRank",
    "PairChoice",
    "PairExclusion",
    "Pairing",
    "Pairs",
    "Rank",
    "RankSummary",
    "Registered",
    "Rejection",
    "TokenRange",
    "TransferJob",
    "TransferOptions",
    "TransferRequest",
    "WireError",
    "from_json",
    "to_json",
]
