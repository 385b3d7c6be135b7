"""``kvroute check --url``: the given layouts' documents put to a live kvroute's dry-run admission.

Each layout given (``--context``, ``--generation`` or both) becomes a new instance of its role whose
ranks the server checks against the deployment's live ranks exactly as registering them would,
storing nothing (``POST /v1/deployments/{d}/admission-checks``). Its answer is printed as the local
check prints a refusal; exit 0 admitted, 1 refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvroute.cli.common import CommandError
from kvroute.cli.plan import FETCH_TIMEOUT_SECONDS, TOKEN_VARIABLES
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
    deployment = urllib.parse.quote(args.deployment, safe="")
    url = f"{args.url.rstrip('/')}/v1/deployments/{deployment}/admission-checks"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    token = args.token or next(
        (os.environ[name] for name in TOKEN_VARIABLES if os.environ.get(name)), None
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise CommandError(f"{url} answered {error.code}: {_detail(error)}") from None
    except (urllib.error.URLError, OSError) as error:
        raise CommandError(f"cannot reach {args.url}: {getattr(error, 'reason', error)}") from None
    return answer


def _detail(error: urllib.error.HTTPError) -> str:
    raw = error.read().decode(errors="replace")
    try:
        problem = json.loads(raw)
    except json.JSONDecodeError:
        return raw[:200]
    return str(problem.get("detail", raw[:200])) if isinstance(problem, dict) else raw[:200]
