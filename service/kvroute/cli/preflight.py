"""``kvroute describe`` and ``kvroute check``: registration documents and verdicts from model configs.

``describe`` writes every rank's registration document for a config.json and a layout (JSON lines on
stdout, or one file per rank with ``--out``). ``check`` answers "would this context/generation pair
be admitted?" as registration would (code, field, both values), exit 0 compatible / 1 refused, with
the plan summary; ``--plan`` adds a generation rank's plan table, ``--svg`` its picture. With
``--url`` each given layout is checked against a live deployment's registered instances by the
server's dry-run admission, which stores nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvroute.api.errors import GEOMETRY_STATUS
from kvroute.cli.common import CommandError
from kvroute.cli.preflight_remote import remote_verdict
from kvroute.engines.models import (
    Layout,
    LayoutError,
    ModelSpec,
    UnsupportedConfig,
    UnsupportedLayout,
    load_config,
    model_spec,
    parse_layout,
)
from kvroute.engines.models import layout as layout_module
from kvroute.engines.models.preflight import (
    CONTEXT,
    DEFAULT_PROMPT_TOKENS,
    GENERATION,
    Verdict,
    admit,
    admit_alone,
    describe,
    summary,
)
from kvroute.geometry import GeometryError
from kvroute.pictures import plan_svg
from kvroute.render import plan_text

MODEL_ERRORS = (UnsupportedConfig, UnsupportedLayout)


def add_describe(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "describe",
        help="every rank's registration document for a model config and a layout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="config.json or its directory")
    parser.add_argument("--role", choices=("context", "generation"), default="context")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--split", help="layers per PP stage, e.g. 41/39 (default: vLLM's)")
    parser.add_argument("--dp", type=int, default=1, help="attention-DP groups (1: off)")
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="KV cache dtype: auto, fp8, bfloat16...")
    parser.add_argument("--state-dtype", default="auto", help="Mamba state dtype")
    parser.add_argument("--draft", type=Path, help="draft (Eagle) model config")
    parser.add_argument("--mtp", type=int, default=0, help="MTP layers held as draft layers")
    parser.add_argument("--out", type=Path, help="write rank<N>.json files here instead")
    parser.set_defaults(run=run_describe)


def add_check(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "check",
        help="would a context and a generation layout of a model be admitted together?",
        description=__doc__ + "\n" + (layout_module.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, required=True, help="config.json or its directory")
    parser.add_argument("--context", help='context layout, e.g. "tp=8,pp=2,tpb=32"')
    parser.add_argument("--generation", help='generation layout, e.g. "tp=4,tpb=64,dtype=fp8"')
    parser.add_argument("--generation-model", type=Path, help="the generation side's config")
    parser.add_argument("--draft", type=Path, help="draft (Eagle) config of both sides")
    parser.add_argument("--generation-draft", type=Path, help="the generation side's draft")
    parser.add_argument("--plan", action="store_true", help="print a generation rank's plan")
    parser.add_argument("--rank", type=int, default=0, help="generation rank of --plan/--svg")
    parser.add_argument("--svg", type=Path, help="write that plan's picture to this file")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--json", action="store_true", help="the verdict and summary as JSON")
    remote = parser.add_argument_group("against a live kvroute (stores nothing)")
    remote.add_argument("--url", help="kvroute base URL")
    remote.add_argument("--deployment", help="deployment to check against (with --url)")
    remote.add_argument("--token", help="worker token (default: $KVROUTE_WORKER_TOKEN)")
    remote.add_argument("--instance", help="name the new instance would register under")
    parser.set_defaults(run=run_check)


def _model(path: Path | None) -> ModelSpec | None:
    return None if path is None else model_spec(load_config(path))


def run_describe(args: argparse.Namespace) -> int:
    try:
        model = model_spec(load_config(args.model))
        layout = _layout_of(args)
        instance = describe(model, layout, draft=_model(args.draft))
        verdict = admit_alone(instance)
    except MODEL_ERRORS as error:
        return _unsupported(error)
    except LayoutError as error:
        raise CommandError(str(error)) from None
    _write_documents(instance.documents, args.out)
    if verdict.refusal is not None:
        _print_refusal(verdict, sys.stderr)
        return 1
    return 0


def _layout_of(args: argparse.Namespace) -> Layout:
    parts = [f"tp={args.tp}", f"pp={args.pp}", f"dp={args.dp}", f"tpb={args.tokens_per_block}"]
    parts += [f"dtype={args.dtype}", f"state_dtype={args.state_dtype}", f"mtp={args.mtp}"]
    if args.split:
        parts.append(f"split={args.split}")
    return parse_layout(",".join(parts), args.role)


def _write_documents(documents: tuple[dict[str, Any], ...], out: Path | None) -> None:
    if out is None:
        for document in documents:
            sys.stdout.write(json.dumps(document, separators=(",", ":")) + "\n")
        return
    out.mkdir(parents=True, exist_ok=True)
    for rank, document in enumerate(documents):
        (out / f"rank{rank}.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {len(documents)} documents to {out}/rank0..{len(documents) - 1}.json")


def run_check(args: argparse.Namespace) -> int:
    try:
        model = model_spec(load_config(args.model))
        other = _model(args.generation_model) or model
        draft = _model(args.draft)
        other_draft = _model(args.generation_draft) or draft
        if args.url is not None:
            return remote_verdict(args, model, other, draft, other_draft)
        if not args.context or not args.generation:
            raise CommandError("give --context and --generation (or --url with either)")
        context = describe(model, parse_layout(args.context, "context"), draft=draft)
        generation_layout = parse_layout(args.generation, "generation")
        generation = describe(other, generation_layout, draft=other_draft, name=GENERATION)
    except MODEL_ERRORS as error:
        return _unsupported(error)
    except LayoutError as error:
        raise CommandError(str(error)) from None
    verdict = admit(context, generation)
    if verdict.refusal is not None:
        if args.json:
            print(json.dumps(verdict_json(verdict), indent=2))
        else:
            _print_refusal(verdict, sys.stdout)
        return 1
    facts = summary(verdict, generation_layout.tpb, args.prompt_tokens)
    if args.json:
        print(json.dumps({"compatible": True, **facts}, indent=2))
    else:
        _print_summary(context, generation, facts)
    _plan_outputs(args, verdict)
    return 0


def verdict_json(verdict: Verdict) -> dict[str, Any]:
    doc = verdict.to_json()
    if verdict.refusal is not None:
        doc["refusal"]["status"] = GEOMETRY_STATUS.get(verdict.refusal.stage, 422)
    return doc


def _plan_outputs(args: argparse.Namespace, verdict: Verdict) -> None:
    if not args.plan and args.svg is None:
        return
    if not 0 <= args.rank < len(verdict.plans):
        raise CommandError(f"--rank {args.rank}: the generation instance has {len(verdict.plans)}")
    plan = verdict.plans[args.rank]
    if args.plan:
        sys.stdout.write("\n" + plan_text(plan))
    if args.svg is not None:
        args.svg.write_text(plan_svg(plan))


def _unsupported(error: UnsupportedConfig | UnsupportedLayout) -> int:
    what = "config" if isinstance(error, UnsupportedConfig) else "layout"
    print(f"kvroute: unsupported {what}: {error.key}: {error.reason}", file=sys.stderr)
    return 1


def _print_refusal(verdict: Verdict, stream: Any) -> None:
    error = verdict.refusal
    assert isinstance(error, GeometryError)
    status = GEOMETRY_STATUS.get(error.stage, 422)
    peer = f" (against {error.peer_instance} rank {error.peer_rank})" if error.peer_instance else ""
    print(f"refused: {error.code} ({status}) registering {verdict.instance} rank {verdict.rank}{peer}", file=stream)  # fmt: skip
    print(f"  field: {error.field}", file=stream)
    print(f"  local: {json.dumps(error.local)}", file=stream)
    print(f"  peer:  {json.dumps(error.peer)}", file=stream)
    print(f"  {error.detail}", file=stream)


def _print_summary(context: Any, generation: Any, facts: dict[str, Any]) -> None:
    print(
        f"compatible: {CONTEXT} ({len(context.documents)} ranks) -> "
        f"{GENERATION} ({len(generation.documents)} ranks)"
    )
    columns: tuple[str, ...] = ("generation rank", "writers", "bytes/block", "fragments/block")
    columns += ("NIXL descs/block",)
    columns += ("state bytes", "state frags")
    keys: tuple[str, ...] = ("rank", "expected_writers", "bytes_per_block", "fragments_per_block")
    keys += ("nixl_descriptors_per_block", "state_bytes", "state_fragments")
    print(" ".join(f"{name:>{max(len(name), 8)}}" for name in columns))
    for row in facts["receivers"]:
        cells = (
            f"{row[key]:>{max(len(name), 8)}}" for key, name in zip(keys, columns, strict=True)
        )
        print(" ".join(cells))
    prompt = facts["prompt_tokens"]
    print(f"{'context rank':>15} {f'bytes/request ({prompt} tokens)':>30} {'receivers':>9}")
    for row in facts["senders"]:
        print(f"{row['rank']:>15} {row['bytes_per_request']:>30} {row['receivers']:>9}")
