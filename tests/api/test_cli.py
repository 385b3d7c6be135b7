"""The kvroute command line: schema management and serve's refusal to start on a stale schema."""

from __future__ import annotations

import pytest

from kvroute.cli.main import build_parser, main
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
    assert main(["db", "check"]) == 0
    assert "no drift" in capsys.readouterr().out

    assert main(["db", "downgrade", "base"]) == 0
    assert migrate.current(empty_sqlite) is None


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
