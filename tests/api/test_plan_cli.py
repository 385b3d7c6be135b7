"""``kvroute plan``: from registration documents on disk, and from a live server over HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.cli.main import main
from tests.api.conftest import WORKER_TOKEN, register
from tests.api.documents import rank_document

Client = TestClient[web.Request, web.Application]


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(json.dumps(document))
    return path


@pytest.fixture
def documents(tmp_path: Path) -> list[str]:
    senders = [
        str(_write(tmp_path / f"ctx_rank{r}.json", rank_document(tp_size=4, tp_rank=r)))
        for r in range(4)
    ]
    receiver = rank_document(role="generation", tp_size=2, tp_rank=1)
    return [
        "--sender-doc",
        *senders,
        "--receiver-doc",
        str(_write(tmp_path / "gen1.json", receiver)),
    ]


def test_local_plan_prints_the_table(documents, capsys) -> None:
    assert main(["plan", *documents]) == 0
    table = capsys.readouterr().out
    # The receiver rank comes from the document's tp_rank: rank 1 hears from senders 2 and 3.
    assert table.startswith("plan local: ctx0 (dp group 0) -> gen0 rank 1 (generation None)")
    senders = {line.split()[0] for line in table.splitlines()[6:] if line.strip()}
    assert senders == {"2", "3"}


def test_local_plan_as_json_names_the_options(documents, capsys) -> None:
    args = ["plan", *documents, "--sender", "p0", "--receiver", "d0", "--rank", "1"]
    assert main([*args, "--format", "json", "--deployment", "m"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["deployment"], plan["sender"]["instance"], plan["receiver"]["instance"]) == (
        "m",
        "p0",
        "d0",
    )
    assert [peer["rank"] for peer in plan["peers"] if peer["sends"]] == [2, 3]


def test_a_zigzag_sender_is_planned_for_the_prompt_length_given(tmp_path, capsys) -> None:
    senders = []
    for cp_rank in range(2):
        document = rank_document()
        document.update(cp_size=2, cp_rank=cp_rank, cp_layout="zigzag")
        senders.append(str(_write(tmp_path / f"ctx{cp_rank}.json", document)))
    receiver = str(_write(tmp_path / "gen.json", rank_document(role="generation")))
    args = ["plan", "--sender-doc", *senders, "--receiver-doc", receiver, "--format", "json"]
    assert main(args) == 1
    assert "prompt_tokens_required" in capsys.readouterr().err
    assert main([*args, "--prompt-tokens", "10"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["prompt_tokens"] == 10
    assert [peer["rank"] for peer in plan["peers"] if peer["sends"]] == [0, 1]


def test_incompatible_documents_are_refused_with_the_field(tmp_path, capsys) -> None:
    sender = _write(tmp_path / "ctx.json", rank_document(head_dim=16))
    receiver = _write(tmp_path / "gen.json", rank_document(role="generation", head_dim=32))
    assert main(["plan", "--sender-doc", str(sender), "--receiver-doc", str(receiver)]) == 1
    error = capsys.readouterr().err
    assert "head_dim_mismatch" in error
    assert "field attention.head_dim: local=32, peer=16" in error


def test_documents_of_some_sender_ranks_are_refused_naming_the_missing_ones(
    documents, capsys
) -> None:
    one_of_four = [documents[0], documents[1], *documents[-2:]]
    assert main(["plan", *one_of_four]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "refused (409): sender instance ctx0 has ranks 0 of 4 (missing: 1,2,3)" in captured.err
    # Ranks come from the documents, not from the order of the files.
    reordered = ["--sender-doc", *reversed(documents[1:5]), *documents[5:]]
    assert main(["plan", *reordered, "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [peer["rank"] for peer in plan["peers"] if peer["sends"]] == [2, 3]


def test_a_sender_rank_given_twice_is_a_usage_error(documents, capsys) -> None:
    twice = [documents[0], documents[1], documents[1], *documents[2:]]
    assert main(["plan", *twice]) == 2
    assert "is sender rank 0 again" in capsys.readouterr().err


def test_remote_plan_needs_a_deployment(capsys) -> None:
    assert main(["plan", "--url", "http://127.0.0.1:9", "--rank", "0"]) == 2
    assert "--deployment is required with --url" in capsys.readouterr().err


def test_unreadable_documents_and_missing_sources_are_usage_errors(tmp_path, capsys) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["plan", "--sender-doc", str(broken), "--receiver-doc", str(broken)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert (
        main(["plan", "--sender-doc", str(tmp_path / "absent.json"), "--receiver-doc", str(broken)])
        == 2
    )
    assert "cannot read" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "give --url" in capsys.readouterr().err


async def test_remote_plan_from_a_running_server(
    client: Client, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVROUTE_WORKER_TOKEN", "KVROUTE_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for rank in range(2):
        await register(client, "ctx0", rank, rank_document(tp_size=2, tp_rank=rank))
    await register(client, "gen0", 0, rank_document(role="generation"))
    url = str(client.make_url("")).rstrip("/")
    base = ["plan", "--url", url, "--deployment", "llama", "--rank", "0"]
    # The command blocks on HTTP; run it off the loop that serves the app.
    assert await asyncio.to_thread(main, [*base, "--token", WORKER_TOKEN]) == 0
    table = capsys.readouterr().out
    assert "gen0 rank 0 (generation 1)" in table
    assert "expected writers 2" in table

    assert await asyncio.to_thread(main, [*base, "--token", WORKER_TOKEN, "--format", "svg"]) == 0
    assert capsys.readouterr().out.startswith("<svg")

    assert await asyncio.to_thread(main, base) == 1
    assert "401 Unauthorized" in capsys.readouterr().err
    # The server's variable names configure the command too.
    monkeypatch.setenv("KVROUTE_WORKER_TOKEN", WORKER_TOKEN)
    assert await asyncio.to_thread(main, base) == 0
    assert "gen0 rank 0 (generation 1)" in capsys.readouterr().out
    monkeypatch.delenv("KVROUTE_WORKER_TOKEN")
    missing = [*base[:-1], "5", "--token", WORKER_TOKEN]
    assert await asyncio.to_thread(main, missing) == 1
    assert "receiver instance gen0 rank 5 is not registered" in capsys.readouterr().err
