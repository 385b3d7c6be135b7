"""Process configuration, read once from ``KVROUTE_*`` environment variables.

Everything that varies between deployments lives here (12-factor), is validated when the
process starts, and is handed to ``create_app(settings)`` explicitly: no module reads the
environment on its own. A bad value stops startup with the variable name and the reason,
never a silent fallback to a default.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

ENV_PREFIX = "KVROUTE_"
# The async drivers the store supports; anything else would fail much later, at first query.
SUPPORTED_DRIVERS = frozenset({"sqlite+aiosqlite", "postgresql+asyncpg"})
# Shorter bearer tokens are guessable; refuse them rather than run with weak auth.
MIN_TOKEN_LENGTH = 16


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
    readiness_timeout_seconds: float = Field(default=2.0, gt=0, le=60)
    # How long shutdown waits for in-flight requests after readiness flipped to 503.
    shutdown_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    transfer_workers: int = Field(default=2, ge=1, le=64)
    transfer_queue_size: int = Field(default=256, ge=1, le=100_000)
    # Names this process among replicas sharing one database: a restart fails only the transfer
    # jobs its own previous incarnation left in flight. Must be stable across restarts (a pod name).
    replica_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)

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
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_LENGTH:
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

    Raises ``SettingsError`` naming each offending ``KVROUTE_*`` variable.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


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
