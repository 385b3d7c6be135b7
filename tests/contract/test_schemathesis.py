"""Fuzz the live service with schemathesis against ``api_spec/openapi.yaml``.

A real ``kvroute serve`` process (127.0.0.1, a temporary SQLite database, tokens on) answers
generated requests, valid and invalid. Every answer must be documented in the spec (status,
content type, body schema) and none may be a server error. Bounded: at most
``MAX_EXAMPLES`` per operation, and the event stream, which follows the log until the client
leaves, is always asked for its bounded form (``follow=false``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvroute.live import LiveServer

SPEC = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"
EVENTS = "GET /v1/deployments/{deployment}/events"
MAX_EXAMPLES = 50
WORKER_TOKEN = "contract-worker-token-0123456789"
ADMIN_TOKEN = "contract-admin-token-0123456789"

# Auth goes through the spec's security scheme, so negative cases that drop the token stay
# tokenless (and must be answered 401).
CONFIG = SchemathesisConfig.from_dict(
    {
        "auth": {"openapi": {"bearer": {"bearer": ADMIN_TOKEN}}},
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
    }
)
schema = schemathesis.openapi.from_path(str(SPEC), config=CONFIG)
statuses: Counter[int] = Counter()
operations: set[str] = set()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with LiveServer(
        tmp_path_factory.mktemp("contract"), tokens=(WORKER_TOKEN, ADMIN_TOKEN)
    ) as server:
        yield server.url
    _not_vacuous()


def _not_vacuous() -> None:
    """Once every operation was fuzzed, the answers must show the fuzzing got past auth and
    validation (not, e.g., every request answered 401). Runs after the last case, in any order;
    a run selecting only some operations cannot judge that and checks nothing."""
    every = {result.ok().label for result in schema.get_all_operations()}
    if operations != every:
        return
    assert statuses[200] > 0, statuses
    assert statuses[401] > 0, statuses
    assert sum(count for status, count in statuses.items() if status in (400, 422)) > 0, statuses


def _bounded(case) -> None:
    """A case that would follow the event stream asks for it to end once caught up instead: a
    following stream ends only when the client leaves, so each such case would wait out the
    read timeout (``timeout``, if generated, can be a day). Cases with a malformed ``follow``
    keep it: they are answered 400 before any stream starts."""
    if case.operation.label != EVENTS:
        return
    query = case.query if isinstance(case.query, dict) else {}
    if query.get("follow", "true") in ("true", True):
        case.query = {**query, "follow": "false"}


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_is_documented_and_never_a_server_error(case, base_url):
    # Schema-valid documents are still refused when their geometry is wrong (409/422): that is
    # the service's purpose, so "valid input must be accepted" does not apply here.
    _bounded(case)
    response = case.call_and_validate(
        base_url=base_url,
        excluded_checks=[positive_data_acceptance],
        timeout=10,
    )
    statuses[response.status_code] += 1
    operations.add(case.operation.label)
