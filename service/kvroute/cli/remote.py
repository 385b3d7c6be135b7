"""What the commands that ask a live kvroute share (``kvroute plan --url``, ``kvroute check
--url``): the bearer token, one request, and a refusal's problem+json read once."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

FETCH_TIMEOUT_SECONDS = 30.0
# The server's own variables; plans need the worker scope, which the admin token also grants.
TOKEN_VARIABLES = ("KVROUTE_WORKER_TOKEN", "KVROUTE_ADMIN_TOKEN")


class Unreachable(Exception):
    """No answer came: the server is down, the name does not resolve, the wait ran out."""


class Refused(Exception):
    """A non-2xx answer: its status, its problem+json body (None when it sent none) and its text."""

    def __init__(self, status: int, raw: str) -> None:
        try:
            problem = json.loads(raw)
        except json.JSONDecodeError:
            problem = None
        self.status = status
        self.problem: dict[str, Any] | None = problem if isinstance(problem, dict) else None
        self.raw = raw
        super().__init__(f"{status}: {self.detail}")

    @property
    def detail(self) -> str:
        """The problem's detail, else the start of the body."""
        if self.problem is None:
            return self.raw[:200]
        return str(self.problem.get("detail", self.raw[:200]))


def ask(base_url: str, path: str, token: str | None, body: Any = None) -> bytes:
    """The body of ``GET base_url + path`` (``POST`` of ``body`` as JSON when given), sent with
    ``token`` or the first of ``TOKEN_VARIABLES`` set; raises ``Refused`` or ``Unreachable``."""
    token = token or next(
        (os.environ[name] for name in TOKEN_VARIABLES if os.environ.get(name)), None
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    url = base_url.rstrip("/") + path
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as response:
            answer: bytes = response.read()
    except urllib.error.HTTPError as error:
        raise Refused(error.code, error.read().decode(errors="replace")) from None
    except (urllib.error.URLError, OSError) as error:
        raise Unreachable(f"cannot reach {base_url}: {getattr(error, 'reason', error)}") from None
    return answer
