"""``kvroute check --url``: the given layouts' documents put to a live kvroute's dry-run admission.

Each layout given (``--context``, ``--generation`` or both) becomes a new instance of its role whose
ranks the server checks against the deployment's live ranks exactly as registering them would,
storing nothing (``POST /v1/deployments/{d}/admission-checks``). Its answer is printed as the local
check prints a refusal; exit 0 admitted, 1 refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvroute.cli.common import CommandError
from kvroute.cli.remote import Refused, Unreachable, ask
from kvroute.engines.models import ModelSpec, parse_layout
from kvroute.engines.models.preflight import describe

DEFAULT_NAMES = {"context": "preflight-context", "generation": "preflight-generation"}


def remote_verdict(
    args: argparse.Namespace,
    model: ModelSpec,
    generation_model: ModelSpec,
    draft: ModelSpec | None,
    generation_draft: ModelSpec | None,
) -> int:
    if args.deployment is None:
        raise CommandError("--deployment is required with --url")
    sides = [
        (role, text, spec, spec_draft)
        for role, text, spec, spec_draft in (
            ("context", args.context, model, draft),
            ("generation", args.generation, generation_model, generation_draft),
        )
        if text
    ]
    if not sides:
        raise CommandError("give --context or --generation (or both) to check against --url")
    if args.instance is not None and len(sides) > 1:
        raise CommandError("--instance names one new instance: give one layout with it")
    instances: list[dict[str, Any]] = []
    for role, text, spec, spec_draft in sides:
        name = args.instance or DEFAULT_NAMES[role]
        documents = describe(spec, parse_layout(text, role), draft=spec_draft, name=name).documents
        instances.append({"instance": name, "ranks": list(documents)})
    answer = _post(args, {"instances": instances})
    if args.json:
        print(json.dumps(answer, indent=2))
    elif answer["admitted"]:
        names = ", ".join(entry["instance"] for entry in instances)
        print(f"admitted: {names} ({answer['checked_ranks']} ranks) into {args.deployment}")
    else:
        print_remote_refusal(answer["refusal"], sys.stdout)
    return 0 if answer["admitted"] else 1


def print_remote_refusal(refusal: dict[str, Any], stream: Any) -> None:
    peer = ""
    if refusal.get("peer_instance"):
        peer = f" (against {refusal['peer_instance']} rank {refusal['peer_rank']})"
    print(f"refused: {refusal['code']} ({refusal['status']}) registering {refusal['instance']} rank {refusal['rank']}{peer}", file=stream)  # fmt: skip
    print(f"  field: {refusal['field']}", file=stream)
    print(f"  local: {json.dumps(refusal.get('local'))}", file=stream)
    print(f"  peer:  {json.dumps(refusal.get('peer'))}", file=stream)
    print(f"  {refusal['detail']}", file=stream)


def _post(args: argparse.Namespace, body: dict[str, Any]) -> dict[str, Any]:
    path = f"/v1/deployments/{urllib.parse.quote(args.deployment, safe='')}/admission-checks"
    try:
        answer: dict[str, Any] = json.loads(ask(args.url, path, args.token, body))
    except Refused as refused:
        url = args.url.rstrip("/") + path
        raise CommandError(f"{url} answered {refused.status}: {refused.detail}") from None
    except Unreachable as error:
        raise CommandError(str(error)) from None
    return answer
