"""Who may call what: the access scope of each operation.

Kept apart from the auth middleware so the route table can name a scope per operation
without importing the middleware, and tests can assert the table covers every route.
"""

from __future__ import annotations

from enum import StrEnum


class Scope(StrEnum):
    PUBLIC = "public"  # probes, metrics and the spec: no token
    WORKER = "worker"  # what a worker needs for itself; the admin token also passes
    ADMIN = "admin"  # inventory, deletes and refusals
