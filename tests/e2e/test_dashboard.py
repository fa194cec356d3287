"""The live dashboard in a real headless browser (Debian's chromium, driven by selenium through
the system chromedriver), and the figures it shares with /v1/stats and /metrics, against a real
Redis, real worker processes and uvicorn."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import Select

from app.api.server import ThreadedServer
from app.schemas import JobSpec
from scheduler.lifecycle import JobState
from tasks.dispatch import publish_chunk, release
from tasks.settings import Settings, load_settings
from tasks.store import JobStore
from tests.conftest import ROOT, Processes, wait_for, wait_for_workers
from tests.store_steps import create_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "ops-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcd"
TOKEN = "sld-dashboard-token-0123456789"


def dashboard_settings() -> Settings:
    keys = [{"key": KEY, "tenant": "ops", "tier": "gold", "rate_limit_per_s": 1000,
             "burst": 1000},
            {"key": OTHER_KEY, "tenant": "other"}]
    return load_settings(api={"keys": keys, "dashboard_token": TOKEN})


@pytest.fixture()
def api(stack_env: dict[str, str]) -> Iterator[str]:
    with ThreadedServer(dashboard_settings()) as server:
        yield server.url


def client(url: str, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def simulated(slo: str, steps: int, step_ms: float) -> dict[str, Any]:
    return {"kind": "simulated", "slo": slo, "deadline_s": 60,
            "params": {"steps": steps, "step_ms": step_ms}}


# the browser ----------------------------------------------------------------------------------
@pytest.fixture()
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        message = "needs Debian's chromium and chromium-driver (.ci/run installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,1200", "--force-device-scale-factor=1",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shown_fields(driver: Any) -> dict[str, Any]:
    """Every figure the page shows from the stats: its path and raw value (``data-value``)."""
    pairs = driver.execute_script(
        "return [...document.querySelectorAll('[data-field]')]"
        ".map(e => [e.dataset.field, e.dataset.value, e.textContent]);")
    return {path: (json.loads(value) if value is not None else "<unset>", text)
            for path, value, text in pairs}


def value_at(stats: dict[str, Any], path: str) -> Any:
    value: Any = stats
    for key in path.split("/"):
        if key == "length" and isinstance(value, list):
            return len(value)
        value = value.get(key) if isinstance(value, dict) else (
            value[int(key)] if isinstance(value, list) else None)
    return value


AGES = re.compile(r"(^queue_oldest_age_s/|/age_s$|^load/measured_at_s$)")
"""Figures that move every instant: held to the API within the poll period instead."""


def mismatches(driver: Any, stats: dict[str, Any]) -> list[str]:
    wrong = []
    for path, (shown, text) in shown_fields(driver).items():
        expected = value_at(stats, path)
        if AGES.search(path) and shown is not None and expected is not None:
            if abs(shown - expected) > 2.5:
                wrong.append(f"{path}: page {shown} api {expected}")
        elif shown != expected:
            wrong.append(f"{path}: page {shown!r} ({text!r}) api {expected!r}")
    return wrong


def page_matches_api(driver: Any, api: str) -> bool:
    with client(api) as ops:
        stats = ops.get("/v1/stats").json()
    return not mismatches(driver, stats)


def shown(driver: Any, path: str) -> Any:
    return shown_fields(driver).get(path, (None, ""))[0]


def severe_logs(driver: Any) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE"]


def save_screenshot(driver: Any, path: Path) -> Path:
    """The whole page (not only the viewport), via the DevTools protocol."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    if (ROOT / "bench-out").is_dir():
        shutil.copyfile(path, ROOT / "bench-out" / "dashboard.png")
    return path


def test_the_dashboard_shows_what_v1_stats_says_and_follows_jobs_as_they_finish(
    api: str, processes: Processes, redis_client: redis.Redis, browser: Any, tmp_path: Path,
) -> None:
    processes.worker("w1")
    store = JobStore(redis_client)

    # given a browser without a session: the sign-in page, and a wrong token is refused
    browser.get(api + "/dashboard")
    assert browser.find_element("css selector", "form input[name=token]")
    browser.get(api + "/dashboard?token=not-a-token")
    assert "neither" in browser.find_element("css selector", "#message").text
    browser.get_log("browser")  # those 401 answers are logged as errors; start afresh

    # when the read-only token is exchanged for a session
    browser.get(api + f"/dashboard?token={TOKEN}")

    # then the token leaves the address bar, the session cookie is HttpOnly, the page goes live
    assert browser.current_url == api + "/dashboard"
    cookie = browser.get_cookie("stepline_dashboard")
    assert cookie is not None and cookie["httpOnly"] and TOKEN not in cookie["value"]
    wait_for(lambda: browser.find_element("css selector", "#status").get_attribute(
        "data-state") == "live", 15, "the dashboard to go live")
    assert browser.find_element("css selector", "#viewer").text == "operator"
    wait_for_workers(redis_client, ["w1"])
    wait_for(lambda: shown(browser, "workers/length") == 1, 10, "the worker to show")
    wait_for(lambda: page_matches_api(browser, api), 10, "the page to match /v1/stats")

    # when the timeline is set to its shortest length
    Select(browser.find_element("css selector", "#timeline-length")).select_by_value("30")

    # and a batch job is preempted by hand mid-run, a realtime job runs, the batch job resumes
    with client(api) as ops:
        batch = ops.post("/v1/jobs", json=simulated("batch", 24, 80)).json()["id"]
        wait_for(lambda: store.state(batch) is JobState.RUNNING and store.record(batch).seq >= 2,
                 20, "the batch job to run")
        wait_for(lambda: store.request_preempt(batch, state=JobState.RUNNING,  # not mid-hop
                                               epoch=store.record(batch).epoch), 10,
                 "the preempt flag to land on the running job")
        realtime = ops.post("/v1/jobs", json=simulated("realtime", 4, 30)).json()["id"]
        wait_for(lambda: store.state(batch) is JobState.PREEMPTED, 10, "the preemption")
        wait_for(lambda: store.state(realtime) is JobState.DONE, 20, "the realtime job")
        assert release(store, store.record(batch), queue="batch", by="test", reason="resume")
        wait_for(lambda: store.state(batch) is JobState.DONE, 30, "the batch job to finish")

    # then the page counts both jobs within a poll or two, and still matches /v1/stats
    wait_for(lambda: (shown(browser, "window/classes/realtime/finished"),
                      shown(browser, "window/classes/batch/finished")) == (1, 1), 10,
             "the page to count the finished jobs")
    wait_for(lambda: page_matches_api(browser, api), 10, "the page to match /v1/stats again")
    assert shown(browser, "window/classes/realtime/attainment") == 1.0
    # and the worker's model residency shows: its runner built, no model loaded (no job named
    # one), as its heartbeat says
    assert shown(browser, "workers/0/models/loads") == 0
    attainment = browser.find_element("css selector",
                                      '[data-field="window/classes/realtime/attainment"]')
    assert attainment.text == "100.0 %"
    # and the timeline shows w1 running both jobs, with the preemption marked
    canvas = browser.find_element("css selector", "#timeline")
    assert int(canvas.get_attribute("data-spans")) >= 3  # batch, realtime, batch again
    assert int(canvas.get_attribute("data-preemptions")) == 1
    # and nothing went wrong in the page
    assert severe_logs(browser) == []
    shot = save_screenshot(browser, tmp_path / "dashboard.png")
    assert shot.stat().st_size > 20_000
    assert severe_logs(browser) == []


def test_the_data_route_needs_a_key_token_or_session_and_hides_other_tenants_ids(
    api: str, redis_client: redis.Redis
) -> None:
    # given a job of tenant ops that is the origin
    with client(api) as ops:
        job = ops.post("/v1/jobs", json=simulated("interactive", 2, 5)).json()["id"]
    redis_client.set("sl:origin", job)

    # then without credentials it is a 401 that says how to sign in
    bare = httpx.get(api + "/v1/dashboard/data")
    assert bare.status_code == 401 and "token" in bare.json()["detail"]
    assert httpx.get(api + "/v1/dashboard/data",
                     cookies={"stepline_dashboard": "forged.signature"}).status_code == 401
    # and the read-only token sees every job id; another tenant sees the origin only as active
    as_operator = httpx.get(api + "/v1/dashboard/data",
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert as_operator["viewer"] == "operator" and as_operator["stats"]["origin"] == job
    with client(api, OTHER_KEY) as other:
        as_other = other.get("/v1/dashboard/data").json()
        stats = other.get("/v1/stats").json()
    assert as_other["viewer"] == "tenant other"
    assert as_other["stats"]["origin"] is None and as_other["stats"]["origin_active"]
    assert stats["origin"] is None
    # and the read-only token cannot submit
    refused = httpx.post(api + "/v1/jobs", json=simulated("batch", 1, 1),
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert refused.status_code == 401
    # and only the vendored assets are served, with no CDN in the page
    page = httpx.get(api + "/dashboard", params={"token": TOKEN}, follow_redirects=True).text
    assert "https://" not in page and "http://" not in page
    assert httpx.get(api + "/dashboard/static/uPlot.iife.min.js").status_code == 200
    assert httpx.get(api + "/dashboard/static/..%2Fapi%2Fdashboard.py").status_code == 404


def test_stats_and_metrics_agree_on_queue_ages_and_the_sliding_window(
    api: str, redis_client: redis.Redis, stack_env: dict[str, str]
) -> None:
    store = JobStore(redis_client)
    settings = dashboard_settings()
    with client(api) as ops:
        # given a realtime job waiting (no worker) with a stale message of an old epoch ahead of
        # it, and a batch job that waits since 30 s ago
        waiting = ops.post("/v1/jobs", json=simulated("realtime", 2, 5)).json()["id"]
        stale = store.record(waiting)
        publish_chunk(store, stale, chunk=0, epoch=stale.epoch + 7, queue="realtime")
        older = ops.post("/v1/jobs", json=simulated("batch", 2, 5)).json()["id"]
        redis_client.hset(f"sl:job:{older}", "queued_at", repr(time.time() - 30))
        # and three jobs that ended: two now, one ten minutes ago (outside the 5 min window)
        ended = [create_job(store, JobSpec(kind="simulated", slo="interactive",  # type: ignore[arg-type]
                                    params={"steps": 1, "step_ms": 1}),
                            tenant="ops", tier="gold", num_chunks=1, cost_key="simulated",
                            cost_units=(1.0,), deadline_s=5, now_s=time.time() - 700,
                            queue="interactive")[0] for _ in range(3)]
        for job_id, ago_s in zip(ended, (1, 2, 600), strict=True):
            store.transition(job_id, JobState.FAILED, by="test", reason="drill",
                             now_s=time.time() - ago_s)

        # when both are read
        stats = ops.get("/v1/stats").json()
        metrics = httpx.get(api + "/metrics").text

    # then the waits are the records' queued-at ages, the stale message not counted
    ages = stats["queue_oldest_age_s"]
    assert 0 <= ages["realtime"] < 5 and 29 < ages["batch"] < 40 and ages["interactive"] is None
    assert stats["queues"]["realtime"] == 2  # both messages wait; one of them is stale
    assert metric(metrics, "stepline_queue_oldest_age_seconds", queue="batch") == pytest.approx(
        ages["batch"], abs=2)
    assert metric(metrics, "stepline_queue_oldest_age_seconds", queue="interactive") == 0
    # and the window counts the two recent failures, not the old one; the job count window all 3
    window = stats["window"]
    assert window["seconds"] == settings.api.stats_window == 300
    assert (window["classes"]["interactive"]["finished"],
            window["classes"]["interactive"]["attainment"]) == (2, 0.0)
    assert stats["classes"]["interactive"]["finished"] == 3
    assert metric(metrics, "stepline_jobs_ended_window", slo="interactive") == 2
    assert metric(metrics, "stepline_slo_attainment_window", slo="interactive") == 0.0
    assert metric(metrics, "stepline_stats_window_seconds") == 300


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "")
    found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    assert found, f"{name}{{{wanted}}} not in /metrics"
    return float(found.group(1))


def test_the_grafana_dashboard_and_the_keda_example_use_only_exported_metrics(api: str) -> None:
    # given the metric families /metrics exports
    exported = set(re.findall(r"^# TYPE (\S+) (\w+)$", httpx.get(api + "/metrics").text,
                              re.MULTILINE))
    names = {name for name, _ in exported}
    names |= {f"{n}_{s}" for n, kind in exported if kind in {"counter", "histogram"}
              for s in ("total", "bucket", "count", "sum")}

    # then every metric the deploy files query is one of them
    grafana = json.loads((ROOT / "deploy/grafana/stepline.json").read_text())
    queries = [t["expr"] for p in grafana["panels"] for t in p.get("targets", [])]
    keda = [doc for doc in yaml.safe_load_all((ROOT / "deploy/keda/scaledobject.yaml").read_text())
            if doc]
    scaled = next(d for d in keda if d["kind"] == "ScaledObject")
    queries += [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    used = {m for q in queries for m in re.findall(r"\bstepline_[a-z0-9_]+", q)}
    assert used and used <= names, used - names
    assert scaled["spec"]["scaleTargetRef"]["name"]
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"prometheus"}
