"""The console's files are served from the package, publicly, under a strict CSP; its data is not."""

from __future__ import annotations

from pathlib import Path

from kvroute.api.console import CONTENT_SECURITY_POLICY, console_files
from tests.api.conftest import ADMIN, WORKER

UI = Path(__file__).resolve().parents[2] / "service" / "kvroute" / "ui"


async def test_root_redirects_to_the_console(client):
    response = await client.get("/", allow_redirects=False)
    assert response.status == 302
    assert response.headers["Location"] == "/ui/"


async def test_console_files_are_public_and_locked_down(client):
    page = await client.get("/ui/")
    assert page.status == 200
    assert page.content_type == "text/html"
    assert await page.read() == (UI / "index.html").read_bytes()
    assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    script = await client.get("/ui/console.js")
    assert script.content_type == "text/javascript"
    assert await script.read() == (UI / "console.js").read_bytes()
    assert (await client.get("/ui/console.css")).content_type == "text/css"
    assert set(console_files()) == {p.name for p in UI.iterdir()}


async def test_unknown_or_odd_console_paths_are_problems(client):
    missing = await client.get("/ui/absent.js")
    assert missing.status == 404
    assert "absent.js" in (await missing.json())["detail"]
    odd = await client.get("/ui/..%2Fsettings.py")
    assert odd.status in (404, 422)


async def test_the_data_behind_the_console_needs_the_admin_token(make_client):
    client = await make_client()
    # The page is served to anyone; what it shows is not.
    assert (await client.get("/ui/")).status == 200
    assert (await client.get("/v1/deployments")).status == 401
    assert (await client.get("/v1/deployments", headers=WORKER)).status == 403
    assert (await client.get("/v1/deployments", headers=ADMIN)).status == 200
