"""End-to-end fixtures: the API suite's real-app-factory clients, on both databases."""

from __future__ import annotations

from tests.api.conftest import client, clock, make_client, make_settings

__all__ = ["client", "clock", "make_client", "make_settings"]
