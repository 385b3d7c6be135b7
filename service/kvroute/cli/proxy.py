"""``kvroute proxy``: the OpenAI-compatible P/D front (``kvroute.proxy``) as a command."""

from __future__ import annotations

import argparse
import os

from aiohttp import web

from kvroute.proxy import make_app


def add_proxy(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "proxy",
        help="serve /v1/completions and /v1/chat/completions over a P/D pair of vLLM engines",
        description="Prefills each request on a producer engine and continues it on a consumer, "
        "choosing the pair among the live engines kvroute allows (its pairs answer). Engines "
        'register their OpenAI address with the connector setting "endpoint".',
    )
    parser.add_argument("--kvroute", default="http://127.0.0.1:8080", help="kvroute's URL")
    parser.add_argument("--deployment", required=True, help="the deployment to serve")
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument(
        "--cooldown", type=float, default=10.0, help="seconds an unreachable engine is skipped"
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=120.0,
        help="seconds the proxy keeps routing from kvroute's last answer while kvroute is out "
        "of reach (and routes the pairs it knew while their engines register again after)",
    )
    parser.set_defaults(run=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    app = make_app(
        args.kvroute,
        args.deployment,
        token=os.environ.get("KVROUTE_WORKER_TOKEN"),
        cooldown_s=args.cooldown,
        hold_s=args.hold,
    )
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0
