"""Every typed key of the application and request state, in one place.

aiohttp's ``AppKey``/``RequestKey`` give handlers typed access to shared state; string keys are
turned into errors in pytest (``NotAppKeyWarning``), so nothing may bypass this module.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from kvroute.api.metrics import Metrics
from kvroute.api.problems import Problem
from kvroute.api.scopes import Scope
from kvroute.api.spec import SpecValidator, ValidatedRequest
from kvroute.control.events import EventHub
from kvroute.control.inventory import Inventory
from kvroute.control.plan_answers import PlanAnswers
from kvroute.control.plans import PlanService
from kvroute.control.registry import Registry
from kvroute.settings import Settings
from kvroute.store.engine import Engine, SessionMaker

if TYPE_CHECKING:  # the data plane imports torch, which the control plane may lack
    from kvroute.control.transfers import TransferService
    from kvroute.transfer.engine import CopyEngine


@dataclass
class Lifecycle:
    """Mutable process state that outlives a request, moved forward once shutdown starts.

    ``draining``: readiness answers 503 so load balancers stop routing here, while every request
    is still served. ``stopping``: the listener is closing; mutating requests that still arrive
    on open connections are refused with 503 ``draining``.
    """

    draining: bool = False
    stopping: bool = False


settings_key = web.AppKey("settings", Settings)
spec_validator_key = web.AppKey("spec_validator", SpecValidator)
spec_text_key = web.AppKey("spec_text", bytes)
metrics_key = web.AppKey("metrics", Metrics)
lifecycle_key = web.AppKey("lifecycle", Lifecycle)
route_scopes_key = web.AppKey("route_scopes", dict[tuple[str, str], Scope])
engine_key = web.AppKey("engine", Engine)
sessionmaker_key = web.AppKey("sessionmaker", SessionMaker)
reaper_key = web.AppKey("reaper", asyncio.Task[None])
registry_key = web.AppKey("registry", Registry)
event_hub_key = web.AppKey("event_hub", EventHub)
inventory_key = web.AppKey("inventory", Inventory)
plan_service_key = web.AppKey("plan_service", PlanService)
plan_answers_key = web.AppKey("plan_answers", PlanAnswers)
transfer_service_key: web.AppKey[TransferService] = web.AppKey("transfer_service")
# Optional: an embedder's copy engine (e.g. one fixed strategy); the default engine otherwise.
copy_engine_key: web.AppKey[CopyEngine] = web.AppKey("copy_engine")

request_id_key = web.RequestKey("request_id", str)
validated_key = web.RequestKey("validated", ValidatedRequest)
# The error answered, for the access line (its code and field say why a 4xx happened).
problem_key = web.RequestKey("problem", Problem)
