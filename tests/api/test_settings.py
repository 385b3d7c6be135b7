"""Configuration fails fast, naming the KVROUTE_* variable."""

from __future__ import annotations

import pytest

from kvroute.settings import SettingsError, load_settings

TOKEN = "t" * 16


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "PORT", "DATABASE_URL", "WORKER_TOKEN", "ADMIN_TOKEN", "LOG_FORMAT"):
        monkeypatch.delenv(f"KVROUTE_{name}", raising=False)


def test_defaults_bind_loopback_with_embedded_sqlite():
    settings = load_settings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.database_url == "sqlite+aiosqlite:///./kvroute.db"
    assert settings.is_sqlite
    assert not settings.auth_enabled


def test_environment_is_read_with_the_prefix(monkeypatch):
    monkeypatch.setenv("KVROUTE_PORT", "9001")
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", "a" * 20)
    settings = load_settings()
    assert settings.port == 9001
    assert settings.auth_enabled
    assert "a" * 20 not in repr(settings)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("KVROUTE_PORT", "eighty", "KVROUTE_PORT='eighty'"),
        ("KVROUTE_PORT", "70000", "KVROUTE_PORT='70000'.*65535"),
        ("KVROUTE_LOG_FORMAT", "xml", "KVROUTE_LOG_FORMAT='xml'"),
        ("KVROUTE_DATABASE_URL", "mysql://x/y", "KVROUTE_DATABASE_URL='mysql://x/y'"),
        ("KVROUTE_ADMIN_TOKEN", "short", "KVROUTE_ADMIN_TOKEN=<secret>"),
    ],
)
def test_invalid_values_name_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=message):
        load_settings()


def test_no_tokens_means_loopback_only():
    with pytest.raises(SettingsError, match=r"KVROUTE_HOST=0\.0\.0\.0 is not loopback"):
        load_settings(host="0.0.0.0")
    assert load_settings(host="::1").host == "::1"
    assert load_settings(host="0.0.0.0", admin_token=TOKEN).host == "0.0.0.0"


def test_worker_token_needs_a_distinct_admin_token():
    with pytest.raises(SettingsError, match="KVROUTE_ADMIN_TOKEN must be set"):
        load_settings(worker_token=TOKEN)
    with pytest.raises(SettingsError, match="must differ"):
        load_settings(worker_token=TOKEN, admin_token=TOKEN)
