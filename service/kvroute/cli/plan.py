"""``kvroute plan``: a plan as a table (or JSON, or SVG), fetched from a server or computed locally.

Two sources, one output. ``--url`` asks a running kvroute for the plan of live ranks (what workers
get). ``--sender-doc``/``--receiver-doc`` plan from registration documents on disk (docs/geometry.md shape),
checked exactly as registration would check them, so a geometry can be tried before any worker
starts. Every rank is numbered from its document's ``tp_rank``/``pp_rank`` (``--rank`` may name the
receiver's); as on the server, a plan needs every rank of the sender instance, so a missing sender
document is refused naming the ranks, never planned with part of the bytes.

Tokens (``--url``): ``--token``, else ``KVROUTE_WORKER_TOKEN``, else ``KVROUTE_ADMIN_TOKEN``: the
variables the server reads, so one environment configures both.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvroute.cli.remote import TOKEN_VARIABLES, Refused, Unreachable, ask
from kvroute.geometry import (
    GeometryError,
    Plan,
    RankRegistration,
    build_plan,
    check_registration,
    missing_ranks,
)
from kvroute.pictures import plan_svg
from kvroute.render import plan_text

LOCAL_DEPLOYMENT = "local"

stderr = Console(stderr=True, highlight=False)


class PlanCommandError(Exception):
    """A problem the user can fix (unreadable file, unreachable server); exit status 2."""


class RefusedByServer(Exception):
    """The server answered an error; the message carries its problem detail."""


class IncompleteSender(Exception):
    """Documents of only some sender ranks: the server would answer 409 for the same plan."""


def add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "plan",
        help="print a transfer plan, from a server (--url) or from registration documents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    remote = parser.add_argument_group("from a running server")
    remote.add_argument("--url", help="kvroute base URL, e.g. http://127.0.0.1:8080")
    remote.add_argument(
        "--deployment",
        help=f"deployment name (required with --url; documents are labelled {LOCAL_DEPLOYMENT!r})",
    )
    remote.add_argument(
        "--token", help=f"bearer token (default: ${TOKEN_VARIABLES[0]}, else ${TOKEN_VARIABLES[1]})"
    )
    local = parser.add_argument_group("from registration documents")
    local.add_argument("--sender-doc", nargs="+", type=Path, help="sender ranks' JSON, rank order")
    local.add_argument("--receiver-doc", type=Path, help="the receiver rank's JSON")
    parser.add_argument("--sender", default="ctx0", help="sender (context) instance name")
    parser.add_argument("--receiver", default="gen0", help="receiver (generation) instance name")
    parser.add_argument("--rank", type=int, help="receiver rank (local default: from its document)")
    parser.add_argument("--sender-dp-rank", type=int, default=0, help="sender attention-DP group")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help="prompt length, for a sender whose CP ranks hold prefill chunks (contiguous, zigzag)",
    )
    parser.add_argument("--format", choices=("text", "json", "svg"), default="text")
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    try:
        if args.url is not None:
            if args.sender_doc or args.receiver_doc:
                raise PlanCommandError("give either --url or --sender-doc/--receiver-doc, not both")
            output = fetch_plan(args)
        elif args.sender_doc and args.receiver_doc:
            output = render(local_plan(args), args.format)
        else:
            raise PlanCommandError("give --url, or --sender-doc and --receiver-doc")
    except PlanCommandError as exc:
        stderr.print(f"kvroute plan: {exc}", markup=False, soft_wrap=True)
        return 2
    except GeometryError as exc:
        stderr.print(
            f"kvroute plan: refused ({exc.code}): {exc.detail} "
            f"[field {exc.field}: local={exc.local!r}, peer={exc.peer!r}]",
            markup=False,
            soft_wrap=True,
        )
        return 1
    except RefusedByServer as exc:
        stderr.print(f"kvroute plan: {exc}", markup=False, soft_wrap=True)
        return 1
    except IncompleteSender as exc:
        stderr.print(f"kvroute plan: refused (409): {exc}", markup=False, soft_wrap=True)
        return 1
    sys.stdout.write(output)
    return 0


def render(plan: Plan, plan_format: str) -> str:
    if plan_format == "json":
        return json.dumps(plan.to_json(), indent=2) + "\n"
    return plan_svg(plan) if plan_format == "svg" else plan_text(plan)


def _read_document(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise PlanCommandError(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise PlanCommandError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise PlanCommandError(f"{path} holds a {type(document).__name__}, not a JSON object")
    return document


def _registration(path: Path, *, deployment: str, instance: str) -> RankRegistration:
    """The document as a rank numbered as the instance check requires (CP fastest, then TP, then PP)."""
    registration = RankRegistration.from_json(
        _read_document(path), deployment=deployment, instance=instance, rank=0
    )
    position = registration.pp_rank * registration.tp_size + registration.tp_rank
    return replace(registration, rank=position * registration.cp_size + registration.cp_rank)


def sender_ranks(args: argparse.Namespace, deployment: str) -> list[RankRegistration]:
    """Every sender rank, checked as registration would; refused unless the instance is whole."""
    senders: list[RankRegistration] = []
    for path in args.sender_doc:
        sender = _registration(path, deployment=deployment, instance=args.sender)
        if any(known.rank == sender.rank for known in senders):
            raise PlanCommandError(f"{path} is sender rank {sender.rank} again")
        check_registration(sender, senders, [])
        senders.append(sender)
    expected = senders[0].tp_size * senders[0].pp_size * senders[0].cp_size
    missing = missing_ranks(expected, (sender.rank for sender in senders))
    if missing:
        given = ",".join(str(sender.rank) for sender in sorted(senders, key=lambda s: s.rank))
        raise IncompleteSender(
            f"sender instance {args.sender} has ranks {given} of {expected} "
            f"(missing: {','.join(map(str, missing))}); give every sender rank's document "
            "to --sender-doc"
        )
    return sorted(senders, key=lambda sender: sender.rank)


def local_plan(args: argparse.Namespace) -> Plan:
    """Checks the documents as registration would (instance, then peers), then plans."""
    deployment = args.deployment or LOCAL_DEPLOYMENT
    senders = sender_ranks(args, deployment)
    receiver = _registration(args.receiver_doc, deployment=deployment, instance=args.receiver)
    if args.rank is not None:
        receiver = replace(receiver, rank=args.rank)
    check_registration(receiver, [], senders)
    return build_plan(
        senders, receiver, sender_dp_rank=args.sender_dp_rank, prompt_tokens=args.prompt_tokens
    )


def fetch_plan(args: argparse.Namespace) -> str:
    if args.rank is None:
        raise PlanCommandError("--rank (the receiver rank) is required with --url")
    if args.deployment is None:
        raise PlanCommandError("--deployment is required with --url")
    params: dict[str, Any] = {
        "sender": args.sender,
        "receiver": args.receiver,
        "receiver_rank": args.rank,
        "sender_dp_rank": args.sender_dp_rank,
        "format": args.format,
    }
    if args.prompt_tokens is not None:
        params["prompt_tokens"] = args.prompt_tokens
    query = urllib.parse.urlencode(params)
    deployment = urllib.parse.quote(args.deployment, safe="")
    try:
        body = ask(args.url, f"/v1/deployments/{deployment}/plans?{query}", args.token)
    except Refused as refused:
        title = "" if refused.problem is None else f" {refused.problem.get('title', '')}"
        raise RefusedByServer(f"{refused.status}{title}: {refused.detail}") from refused
    except Unreachable as error:
        raise PlanCommandError(str(error)) from error
    text = body.decode()
    if args.format == "json":
        return json.dumps(json.loads(text), indent=2) + "\n"
    return text
