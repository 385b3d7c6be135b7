"""The web console, clicked through in Debian's headless chromium against a live kvroute.

The server holds a deployment with a context TP2 and a generation TP1 instance on shared-memory
pools, a finished transfer job between them, a refused registration, and an incompatible pair (a
generation rank written to the store directly, as an older kvroute might have admitted it): every
kind of thing the console shows. ``.ci/run`` installs chromium and chromium-driver.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvroute.client import KvrouteClient, KvrouteError, RequestBlocks
from kvroute.geometry import RankRegistration
from kvroute.live import LiveServer
from kvroute.store.engine import create_engine, dispose
from kvroute.store.rank_writes import write_admitted
from tests.client.live import ADMIN_TOKEN, WORKER_TOKEN
from tests.documents import rank_document
from tests.models.configs import raw
from tests.transfer.conftest import Owners

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 20.0
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


def _admit_without_checks(url: str, instance: str, document: dict[str, Any]) -> None:
    """Stores a rank the boundary would refuse, as an older kvroute's rules might have."""

    async def write() -> None:
        engine = create_engine(url)
        try:
            reg = RankRegistration.from_json(
                document, deployment="llama", instance=instance, rank=0
            )
            now = datetime.now(UTC)
            async with engine.begin() as connection:
                await write_admitted(connection, [(reg, None)], now)
        finally:
            await dispose(engine)

    asyncio.run(write())


def _populate(server: LiveServer, owners: Owners) -> dict[str, str]:
    def shm(document: dict[str, Any], seed: int) -> dict[str, Any]:
        pool = document["pools"][0]
        size = pool["slot_stride"] * pool["num_slots"]
        pool["memory"] = {"backend": "shm", "name": owners.create("workers", size, seed)}
        return document

    with KvrouteClient(server.url, token=WORKER_TOKEN) as worker:
        for rank in range(2):
            document = shm(rank_document(tp_size=2, tp_rank=rank, num_slots=8), rank)
            worker.register("llama", "ctx0", rank, document)
        worker.register("llama", "gen0", 0, shm(rank_document(role="generation", num_slots=8), 9))
        job = worker.submit_transfer(
            "llama",
            sender="ctx0",
            receiver="gen0",
            receiver_ranks=[0],
            blocks=RequestBlocks([0, 1, 2], [5, 6, 7]),
        )
        finished = worker.wait_transfer(job.id, limit_s=WAIT_S)
        assert finished.state == "succeeded", finished.error
        element = {
            "layer": 2,
            "head": 1,
            "kv": "V",
            "token": 9,
            "detail": "layer 2 head 1 V, token 9",
        }
        failed = {"producer": "ctx0", "consumer": "gen0", "consumer_rank": 0, "state": "failed",
                  "source": "canary", "element": element, "cost_ms": 12.5}  # fmt: skip
        worker.report_kv_path("llama", failed)
        with pytest.raises(KvrouteError) as refused:
            worker.register("llama", "gen-bad", 0, rank_document(role="generation", head_dim=32))
        assert refused.value.status == 409
    _admit_without_checks(
        server.database_url, "gen1", rank_document(role="generation", head_dim=32)
    )
    return {"job": finished.id}


@pytest.fixture(scope="module")
def console_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    owners = Owners(("workers",))
    server = LiveServer(tmp_path_factory.mktemp("console"), tokens=(WORKER_TOKEN, ADMIN_TOKEN))
    try:
        server.start()
        yield server, _populate(server, owners)
    finally:
        server.stop()
        owners.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are missing: .ci/run installs them")
        pytest.skip(
            "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="kvroute-chromium-")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, condition: Any) -> Any:
    return WebDriverWait(driver, WAIT_S).until(condition)


def _page(driver: WebDriver, name: str) -> None:
    _wait(driver, lambda d: d.find_element(By.ID, "view").get_attribute("data-page") == name)


def _rows(driver: WebDriver, table: str) -> list[list[str]]:
    rows = driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
    return [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")] for row in rows]


def _loaded(driver: WebDriver, image: str) -> bool:
    return bool(
        driver.execute_script(
            "const i = document.getElementById(arguments[0]);"
            "return i !== null && i.complete && i.naturalWidth > 0;",
            image,
        )
    )


def _use_token(driver: WebDriver, token: str) -> None:
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "token-save").click()


def test_console_needs_the_admin_token(browser: WebDriver, console_server: Any) -> None:
    server, _ = console_server
    browser.get(server.url + "/")  # redirects to /ui/
    assert browser.current_url == server.url + "/ui/"
    message = browser.find_element(By.ID, "message")
    _wait(browser, lambda _: "401" in message.text)
    _use_token(browser, WORKER_TOKEN)
    _wait(browser, lambda _: "403" in message.text)
    browser.find_element(By.ID, "token-forget").click()
    _wait(browser, lambda _: "401" in message.text)


def test_clicking_through_deployment_refusals_jobs_and_a_plan(
    browser: WebDriver, console_server: Any
) -> None:
    server, made = console_server
    browser.get(server.url + "/ui/")
    _use_token(browser, ADMIN_TOKEN)
    _page(browser, "deployments")
    assert _rows(browser, "deployments")[0][:4] == ["llama", "3", "4", "0"]
    browser.find_element(By.ID, "deployment-llama").click()
    _page(browser, "deployment:llama")

    # Instances, ranks, leases and generations.
    assert [row[:3] for row in _rows(browser, "ranks-ctx0")] == [
        ["0", "live", "1"],
        ["1", "live", "1"],
    ]
    assert [row[0] for row in _rows(browser, "instances")] == ["ctx0", "gen0", "gen1"]

    # The matrix: each refusal with its code, field and both values, and its picture.
    by_pair = {(row[0], row[1]): row for row in _rows(browser, "compatibility")}
    assert by_pair[("gen0", "ctx0")][2] == "compatible"
    assert by_pair[("gen1", "ctx0")][2:7] == [
        "incompatible",
        "head_dim_mismatch",
        "attention.head_dim",
        "32",
        "16",
    ]
    _wait(browser, lambda d: _loaded(d, "compatibility-picture"))

    # KV integrity: the failed canary, its first wrong element and cost.
    (path,) = _rows(browser, "kv-paths")
    assert path[:6] == [
        "ctx0",
        "gen0 rank 0",
        "failed",
        "canary",
        "layer 2 head 1 V, token 9",
        "12.5",
    ]

    # Transfer jobs.
    (job,) = _rows(browser, "transfers")
    assert (job[0], job[1], job[3], job[4], job[5]) == (
        made["job"][:8],
        "ctx0 -> gen0",
        "3",
        "block pairs",
        "succeeded",
    )

    # A plan as picture and table; an incompatible pair's plan is refused with its reason.
    Select(browser.find_element(By.ID, "plan-receiver")).select_by_value("gen0")
    browser.find_element(By.ID, "plan-show").click()
    _wait(browser, lambda d: d.find_element(By.ID, "plan").get_attribute("data-plan"))
    _wait(browser, lambda d: _loaded(d, "plan-picture"))
    plan = _rows(browser, "plan-table")
    assert sorted({(row[0], row[1]) for row in plan}) == [("0", "yes"), ("1", "yes")]
    assert browser.find_element(By.ID, "plan-summary").text.startswith(
        "ctx0 -> gen0 rank 0: 2 writers"
    )
    Select(browser.find_element(By.ID, "plan-receiver")).select_by_value("gen1")
    browser.find_element(By.ID, "plan-show").click()
    message = browser.find_element(By.ID, "message")
    _wait(browser, lambda _: "409 head_dim_mismatch" in message.text)

    # Recent refusals.
    browser.find_element(By.ID, "nav-refusals").click()
    _page(browser, "refusals")
    refusal = next(row for row in _rows(browser, "refusals") if row[2] == "gen-bad")
    assert refusal[5:9] == ["head_dim_mismatch", "attention.head_dim", "32", "16"]

    stored = browser.execute_script(
        "return [sessionStorage.getItem('kvroute.adminToken'), localStorage.length];"
    )
    assert stored == [ADMIN_TOKEN, 0]


def test_preflight_form_answers_with_the_worker_token(
    browser: WebDriver, console_server: Any
) -> None:
    """A pasted config and two layouts: the refusal as registration gives it, then a compatible
    pair's summary, plan table and picture; the worker token is enough (nothing is written)."""
    server, _ = console_server
    browser.get(server.url + "/ui/#/preflight")
    browser.find_element(By.ID, "token-forget").click()
    _use_token(browser, WORKER_TOKEN)
    _page(browser, "preflight")
    config = json.dumps(raw("llama-3.1-70b"))
    browser.execute_script(
        "document.getElementById('preflight-model').value = arguments[0];", config
    )
    layout = browser.find_element(By.ID, "preflight-generation")
    layout.clear()
    layout.send_keys("tp=3,tpb=64")
    browser.find_element(By.ID, "preflight-check").click()
    result = browser.find_element(By.ID, "preflight-result")
    _wait(browser, lambda _: result.get_attribute("data-verdict") == "refused")
    ((code, status, field, local, peer, *_),) = _rows(browser, "preflight-refusal")
    assert (code, status, field, local, peer) == (
        "tp_heads_not_divisible",
        "422",
        "views[0].total_kv_heads",
        "8",
        "3",
    )
    layout.clear()
    layout.send_keys("tp=4,tpb=64")
    browser.find_element(By.ID, "preflight-check").click()
    _wait(browser, lambda _: result.get_attribute("data-verdict") == "compatible")
    _wait(browser, lambda d: _loaded(d, "preflight-picture"))
    assert [row[:2] for row in _rows(browser, "preflight-receivers")] == [
        [str(rank), "4"] for rank in range(4)
    ]
    assert len(_rows(browser, "preflight-senders")) == 16
    assert "gen0 rank 0" in browser.find_element(By.ID, "preflight-plan").text
    browser.execute_script("document.getElementById('preflight-model').value = '{';")
    browser.find_element(By.ID, "preflight-check").click()
    message = browser.find_element(By.ID, "message")
    _wait(browser, lambda _: "model config is not JSON" in message.text)


def test_the_deployment_page_follows_the_event_stream(
    browser: WebDriver, console_server: Any
) -> None:
    """No reload and no timer: a registration elsewhere redraws the page through the events."""
    from selenium.common.exceptions import StaleElementReferenceException

    server, _ = console_server
    browser.get(server.url + "/ui/#/deployments/llama")
    _use_token(browser, ADMIN_TOKEN)
    _page(browser, "deployment:llama")
    redrawn = WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    redrawn.until(lambda d: d.find_element(By.ID, "live").text.startswith("live: watching"))
    # A generation rank like gen0: the context peers' geometry admits it (gen1, stored past the
    # checks with another head_dim, would refuse a new context rank).
    with KvrouteClient(server.url, token=WORKER_TOKEN) as worker:
        worker.register("llama", "gen5", 0, rank_document(role="generation", lease_seconds=600))
    redrawn.until(lambda d: "gen5" in [row[0] for row in _rows(d, "instances")])
    redrawn.until(lambda d: "gen5" in d.find_element(By.ID, "live").text)
