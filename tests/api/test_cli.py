"""The kvroute command line: schema management and serve's refusal to start on a stale schema."""

from __future__ import annotations

import re

import pytest

import kvroute
from kvroute.cli.main import build_parser, main
from kvroute.settings import Settings
from kvroute.store import migrate


@pytest.fixture
def empty_sqlite(tmp_path, monkeypatch) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    monkeypatch.setenv("KVROUTE_DATABASE_URL", url)
    return url


def test_db_upgrade_current_check_downgrade(empty_sqlite, capsys):
    assert main(["db", "current"]) == 0
    assert capsys.readouterr().out.strip() == "none"
    assert main(["db", "check"]) == 2
    assert "kvroute db upgrade" in capsys.readouterr().err

    assert main(["db", "upgrade"]) == 0
    assert migrate.current(empty_sqlite) == migrate.head()
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"cli.db: migrated from none (empty schema) to {migrate.head()} (head)")
    )
    assert main(["db", "upgrade"]) == 0
    assert f"already at {migrate.head()} (head); nothing to do" in capsys.readouterr().out
    assert main(["db", "check"]) == 0
    assert "no drift" in capsys.readouterr().out

    assert main(["db", "downgrade", "base"]) == 0
    assert migrate.current(empty_sqlite) is None
    assert capsys.readouterr().out.strip().endswith("to none (empty schema)")


def test_db_upgrade_never_prints_a_password(tmp_path, monkeypatch, capsys):
    from kvroute.cli.db import migration_report

    url = "postgresql+asyncpg://kvroute:hunter2-secret@db:5432/kvroute"
    line = migration_report(url, None, "abc", "abc")
    assert "hunter2" not in line
    assert (
        line
        == "postgresql+asyncpg://kvroute:***@db:5432/kvroute: migrated from none (empty schema) to abc (head)"
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvroute {kvroute.__version__}"


def test_serve_help_lists_every_kvroute_variable(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for name in Settings.model_fields:
        assert f"KVROUTE_{name.upper()}" in text
    # Column widths follow the longest name; the descriptions come from the fields.
    assert re.search(r"KVROUTE_PORT +int >=0 <=65535, default: 8080\n", text)
    assert re.search(r"KVROUTE_LOG_FORMAT +json\|console, default: json\n", text)
    assert re.search(r"KVROUTE_ADMIN_TOKEN +secret, default: unset\n", text)


@pytest.mark.postgres
def test_serve_refuses_a_postgres_schema_not_at_head(postgres_test_url, monkeypatch, capsys):
    migrate.downgrade(postgres_test_url, "base")
    try:
        monkeypatch.setenv("KVROUTE_DATABASE_URL", postgres_test_url)
        assert main(["serve", "--port", "0"]) == 2
        assert "run `kvroute db upgrade` first" in capsys.readouterr().err
    finally:
        migrate.upgrade(postgres_test_url)


def test_serve_refuses_a_public_bind_without_tokens(empty_sqlite, monkeypatch, capsys):
    monkeypatch.delenv("KVROUTE_ADMIN_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "not loopback" in capsys.readouterr().err


def test_parser_knows_every_subcommand():
    parser = build_parser()
    assert parser.parse_args(["serve", "--port", "9"]).port == 9
    assert parser.parse_args(["db", "downgrade", "base"]).revision == "base"
    with pytest.raises(SystemExit):
        parser.parse_args(["db", "downgrade"])
