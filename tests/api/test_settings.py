"""Configuration fails fast, naming the KVROUTE_* variable."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvroute.settings import ENV_PREFIX, TOOLING_VARIABLES, Settings, SettingsError, load_settings

TOKEN = "t" * 16


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)


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


@pytest.mark.parametrize("token", [" " * 16, "\t" * 20, " " * 8 + "x" * 16, "x" * 16 + "\n"])
def test_a_blank_or_spaced_token_is_refused(monkeypatch, token):
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", token)
    with pytest.raises(
        SettingsError, match=r"KVROUTE_ADMIN_TOKEN=<secret>: (is blank|must be printable)"
    ):
        load_settings(host="0.0.0.0")
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("KVROUTE_WORKER_TOKEN", token)
    with pytest.raises(SettingsError, match="KVROUTE_WORKER_TOKEN=<secret>"):
        load_settings()


def test_an_unknown_kvroute_variable_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVROUTE_ADMIN_TOKNE", TOKEN)
    with pytest.raises(SettingsError, match="unknown configuration variable KVROUTE_ADMIN_TOKNE"):
        load_settings()


def test_the_tooling_variables_are_not_settings_but_are_allowed(monkeypatch):
    for name in TOOLING_VARIABLES:
        monkeypatch.setenv(name, "x")
    assert load_settings().port == 8080


def test_every_variable_the_tools_read_is_a_setting_or_a_tooling_variable():
    """A knob of the suite, the benchmarks or the scripts that were neither would make every
    server they start refuse to, as KVROUTE_TEST_WORKERS (documented in README) once did."""
    root = Path(__file__).resolve().parents[2]
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|\$\{)["']?(KVROUTE_[A-Z_]+)""")
    sources = [*root.glob("tests/**/*.py"), *root.glob("bench/*.py"), *root.glob("scripts/*.sh")]
    found = {name for path in sources for name in read.findall(path.read_text())}
    settings = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert "KVROUTE_TEST_WORKERS" in found  # the scan sees scripts/test.sh
    assert found - settings - TOOLING_VARIABLES == set()


def test_shm_owner_uids_are_a_comma_separated_list(monkeypatch):
    monkeypatch.setenv("KVROUTE_SHM_OWNER_UIDS", "1000, 1001")
    assert load_settings().shm_owner_uids == (1000, 1001)
    monkeypatch.setenv("KVROUTE_SHM_OWNER_UIDS", "root")
    with pytest.raises(SettingsError, match="KVROUTE_SHM_OWNER_UIDS='root'"):
        load_settings()


def test_a_lock_timeout_longer_than_the_statement_timeout_is_refused():
    with pytest.raises(SettingsError, match="LOCK_TIMEOUT_SECONDS must not exceed"):
        load_settings(database_lock_timeout_seconds=10, database_statement_timeout_seconds=5)
