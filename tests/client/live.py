"""Tokens and the live server the client tests use (``kvroute.live``)."""

from __future__ import annotations

from pathlib import Path

from kvroute.live import LiveServer, free_port

WORKER_TOKEN = "worker-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"

__all__ = ["ADMIN_TOKEN", "WORKER_TOKEN", "LiveServer", "free_port", "live_server_in"]


def live_server_in(directory: Path, *, tokens: bool = True, port: int | None = None) -> LiveServer:
    return LiveServer(directory, port=port, tokens=(WORKER_TOKEN, ADMIN_TOKEN) if tokens else None)
