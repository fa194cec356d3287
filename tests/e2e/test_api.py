"""The REST API as a client drives it: real Redis, real worker processes, uvicorn over HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.api.server import ThreadedServer
from app.tenants import TenantDirectory, hash_key
from tasks.errors import SettingsError
from tasks.settings import Settings, load_settings
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab",
        "slow": "slow-key-0123456789a", "small": "small-key-0123456789"}


def api_settings(run_dir: Path | None = None) -> Settings:
    keys = [
        {"key": KEYS["alice"], "tenant": "alice", "tier": "gold", "rate_limit_per_s": 1000,
         "burst": 1000},
        {"key": KEYS["bob"], "tenant": "bob"},
        {"key": KEYS["slow"], "tenant": "slow", "rate_limit_per_s": 0.5, "burst": 2},
        {"key": KEYS["small"], "tenant": "small", "max_queued": 2},
    ]
    overrides = {"run_dir": run_dir} if run_dir else {}
    return load_settings(api={"keys": keys}, **overrides)


@pytest.fixture()
def api(stack_env: dict[str, str]) -> Iterator[str]:
    with ThreadedServer(api_settings()) as server:
        yield server.url


def as_tenant(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                        timeout=30)


def simulated(steps: int = 3, step_ms: float = 5, **extra: object) -> dict[str, object]:
    return {"kind": "simulated", "params": {"steps": steps, "step_ms": step_ms}, **extra}


def test_a_job_submitted_over_rest_runs_on_workers_and_serves_its_result(
    api: str, processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    with as_tenant(api, "alice") as alice:
        # given a job that cannot have finished yet
        created = alice.post("/v1/jobs", json=simulated(steps=6, step_ms=40, slo="batch",
                                                        deadline_s=120))
        assert created.status_code == 201, created.text
        job = created.json()
        assert (job["tenant"], job["tier"], job["slo"], job["total"]) == ("alice", "gold",
                                                                           "batch", 6)
        assert created.headers["Location"] == f"/v1/jobs/{job['id']}"
        early = alice.get(f"/v1/jobs/{job['id']}/result")
        assert early.status_code == 409
        assert "DONE" in early.json()["detail"] and job["id"] in early.json()["detail"]

        # when a worker runs it
        wait_for_workers(redis_client, ["w1"])
        wait_for(lambda: alice.get(f"/v1/jobs/{job['id']}").json()["state"] == "DONE", 30,
                 "the job to finish")

        # then the record, the result, the listing, the stats and the metrics all show it
        view = alice.get(f"/v1/jobs/{job['id']}").json()
        assert (view["progress"], view["total"], view["deadline_met"]) == (6, 6, True)
        assert view["result_url"] == f"/v1/jobs/{job['id']}/result"
        assert view["started_at"] and view["turnaround_s"] > 0 and view["preemptions"] == 0
        result = alice.get(view["result_url"])
        assert result.status_code == 200
        assert result.headers["content-type"] == "application/json"
        assert json.loads(result.content)["applied"] == list(range(6))
        listed = alice.get("/v1/jobs", params={"state": "DONE", "class": "batch"}).json()
        assert [j["id"] for j in listed["jobs"]] == [job["id"]]
        assert alice.get("/v1/jobs", params={"class": "realtime"}).json()["jobs"] == []
        stats = alice.get("/v1/stats").json()
        assert stats["classes"]["batch"]["attainment"] == 1.0
        assert [w["name"] for w in stats["workers"]] == ["w1@test"]
        assert "ckpt_cache" in stats["workers"][0]["cache_hit_rates"]
        assert set(stats["queues"]) >= {"realtime", "interactive", "batch"}
        assert [(t["band"], t["tenant"], t["share"]) for t in stats["tenants"]] == [
            ("batch", "alice", 1.0)]
        assert stats["tenants"][0]["service_s"] > 0
        metrics = httpx.get(api + "/metrics").text
        assert 'stepline_jobs_finished_total{slo="batch",state="DONE"} 1.0' in metrics
        assert 'stepline_slo_attainment{slo="batch"} 1.0' in metrics
        assert 'stepline_job_latency_seconds_count{slo="batch"} 1.0' in metrics
        assert "stepline_workers 1.0" in metrics
        # the worker-seconds its chunks ran, charged to its tenant's band by the commits
        assert 'stepline_tenant_service_share{band="batch",tenant="alice"} 1.0' in metrics
        httpx.get(api + "/metrics")  # a second scrape counts nothing twice
        assert 'state="DONE"} 1.0' in httpx.get(api + "/metrics").text

        # and a long job is cancelled at its next chunk boundary
        long = alice.post("/v1/jobs", json=simulated(steps=200, step_ms=20)).json()
        wait_for(lambda: alice.get(f"/v1/jobs/{long['id']}").json()["state"] == "RUNNING", 20,
                 "the long job to run")
        assert alice.delete(f"/v1/jobs/{long['id']}").status_code == 200
        wait_for(lambda: alice.get(f"/v1/jobs/{long['id']}").json()["state"] == "CANCELLED", 20,
                 "the cancel to land")
        gone = alice.get(f"/v1/jobs/{long['id']}/result")
        assert gone.status_code == 409 and "never" in gone.json()["detail"]


def test_a_waiting_job_is_cancelled_at_once_and_the_queue_depth_counts_it(
    api: str, redis_client: redis.Redis
) -> None:
    with as_tenant(api, "alice") as alice:
        job = alice.post("/v1/jobs", json=simulated(slo="realtime")).json()
        assert alice.get("/v1/stats").json()["queues"]["realtime"] == 1
        assert alice.delete(f"/v1/jobs/{job['id']}").json()["state"] == "CANCELLED"


def test_an_idempotency_key_replay_answers_200_with_the_first_job(api: str) -> None:
    with as_tenant(api, "alice") as alice, as_tenant(api, "bob") as bob:
        first = alice.post("/v1/jobs", json=simulated(idempotency_key="order-17"))
        again = alice.post("/v1/jobs", json=simulated(idempotency_key="order-17"))
        other = bob.post("/v1/jobs", json=simulated(idempotency_key="order-17"))
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
    assert again.json()["id"] == first.json()["id"] != other.json()["id"]


def test_requests_without_a_known_key_get_401_and_either_header_works(api: str) -> None:
    assert httpx.get(api + "/v1/jobs").status_code == 401
    wrong = httpx.get(api + "/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["detail"]
    assert httpx.get(api + "/v1/jobs", headers={"X-API-Key": KEYS["bob"]}).status_code == 200
    assert httpx.get(api + "/healthz").json() == {"status": "ok", "redis": "ok"}


def test_a_tenant_can_neither_see_fetch_nor_cancel_another_tenants_job(api: str) -> None:
    with as_tenant(api, "alice") as alice, as_tenant(api, "bob") as bob:
        job_id = alice.post("/v1/jobs", json=simulated()).json()["id"]
        for response in (bob.get(f"/v1/jobs/{job_id}"), bob.get(f"/v1/jobs/{job_id}/result"),
                         bob.delete(f"/v1/jobs/{job_id}")):
            assert response.status_code == 404, response.text
            assert response.json()["detail"] == f"no job {job_id}"
        assert bob.get("/v1/jobs").json()["jobs"] == []
        dependent = bob.post("/v1/jobs", json=simulated(depends_on=[job_id]))
        assert dependent.status_code == 422 and job_id in dependent.json()["detail"]
        assert alice.get(f"/v1/jobs/{job_id}").json()["state"] != "CANCELLED"


def test_a_tenant_over_its_rate_limit_gets_429_with_retry_after(api: str) -> None:
    with as_tenant(api, "slow") as slow:
        answers = [slow.post("/v1/jobs", json=simulated()) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 429]
    assert int(answers[2].headers["Retry-After"]) >= 1
    assert "rate limit" in answers[2].json()["detail"]


def test_a_tenant_at_its_queue_quota_gets_429_until_a_job_ends(api: str) -> None:
    with as_tenant(api, "small") as small:
        first, _ = (small.post("/v1/jobs", json=simulated()).json() for _ in range(2))
        full = small.post("/v1/jobs", json=simulated())
        assert full.status_code == 429 and "quota is 2" in full.json()["detail"]
        assert full.headers["Retry-After"] == "1"
        small.delete(f"/v1/jobs/{first['id']}")
        assert small.post("/v1/jobs", json=simulated()).status_code == 201


@pytest.mark.parametrize(("body", "expected"), [
    ({"kind": "simulated", "params": {"steps": 0}}, "steps"),
    ({"kind": "simulated", "params": {"steps": 2, "bogus": 1}}, "bogus"),
    ({"kind": "nope"}, "kind"),
    ({"kind": "simulated", "slo": "urgent"}, "slo"),
    ({"kind": "simulated", "deadline_s": -1}, "deadline_s"),
    ({"kind": "simulated", "depends_on": ["0123456789abcdef"]}, "0123456789abcdef"),
    ("not json", "JSON"),
])
def test_an_invalid_submission_gets_422_saying_what_is_wrong(
    api: str, body: object, expected: str
) -> None:
    with as_tenant(api, "alice") as alice:
        if isinstance(body, str):
            response = alice.post("/v1/jobs", content=body,
                                  headers={"Content-Type": "application/json"})
        else:
            response = alice.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"]


def test_listing_pages_with_offset_and_with_a_cursor(api: str) -> None:
    with as_tenant(api, "alice") as alice:
        ids = [alice.post("/v1/jobs", json=simulated()).json()["id"] for _ in range(5)]
        newest_first = ids[::-1]
        page = alice.get("/v1/jobs", params={"limit": 2}).json()
        assert [j["id"] for j in page["jobs"]] == newest_first[:2]
        second = alice.get("/v1/jobs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
        assert [j["id"] for j in second["jobs"]] == newest_first[2:4]
        by_offset = alice.get("/v1/jobs", params={"limit": 10, "offset": 3}).json()
        assert [j["id"] for j in by_offset["jobs"]] == newest_first[3:]
        assert by_offset["next_cursor"] is None
        bad = alice.get("/v1/jobs", params={"cursor": "x"})
        assert bad.status_code == 422 and "cursor" in bad.json()["detail"]


def test_a_filter_that_matches_little_pages_on_past_its_scan_budget_and_misses_nothing(
    stack_env: dict[str, str],
) -> None:
    # given an API that examines at most 10 jobs a request, and one matching job under 25 newer
    settings = api_settings()
    settings = settings.model_copy(update={"api": settings.api.model_copy(
        update={"list_scan_limit": 10})})
    with ThreadedServer(settings) as server, as_tenant(server.url, "alice") as alice:
        old = alice.post("/v1/jobs", json=simulated(slo="batch")).json()
        for _ in range(25):
            alice.post("/v1/jobs", json=simulated(slo="realtime"))
        # when a client lists the batch jobs, following the cursor
        found, pages, cursor = [], 0, None
        while pages < 10:
            params = {"class": "batch", "limit": 5, **({"cursor": cursor} if cursor else {})}
            page = alice.get("/v1/jobs", params=params).json()
            found += [j["id"] for j in page["jobs"]]
            pages, cursor = pages + 1, page["next_cursor"]
            if cursor is None:
                break
    # then the short pages carried a cursor, and the old job was found on the last one
    assert found == [old["id"]] and cursor is None
    assert pages == 3


def test_inference_answers_504_with_the_job_id_when_no_worker_finishes_it(api: str) -> None:
    with as_tenant(api, "alice") as alice:
        response = alice.post("/v1/inference", json={"inputs": "hello", "slo": "realtime"})
        answered_at = time.time()
        assert response.status_code == 504, response.text
        job_id = response.json()["job_id"]
        assert job_id in response.json()["detail"]
        job = alice.get(f"/v1/jobs/{job_id}").json()
        assert (job["kind"], job["slo"]) == ("text", "realtime")
        assert job["deadline_at"] <= answered_at < job["deadline_at"] + 5  # waited its 1 s
        bad = alice.post("/v1/inference", json={"inputs": "", "parameters": {}})
        assert bad.status_code == 422 and "inputs" in bad.json()["detail"]


def test_a_redis_outage_is_a_503_with_retry_after_never_a_stack_trace(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    settings = api_settings().model_copy(update={"redis_url": f"unix://{tmp_path}/none.sock"})
    with ThreadedServer(settings) as server:
        headers = {"X-API-Key": KEYS["alice"]}
        answers = [httpx.get(server.url + "/healthz"), httpx.get(server.url + "/metrics"),
                   httpx.post(server.url + "/v1/jobs", json=simulated(), headers=headers),
                   httpx.get(server.url + "/v1/jobs/abc", headers=headers)]
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "2"
        assert "Traceback" not in answer.text and "Redis" in answer.json()["detail"]


def test_openapi_is_published_with_every_route(api: str) -> None:
    spec = httpx.get(api + "/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/result", "/v1/inference",
            "/v1/stats", "/metrics", "/healthz"} <= set(spec["paths"])
    assert {"HTTPBearer", "APIKeyHeader"} <= set(spec["components"]["securitySchemes"])


def test_inference_answers_with_the_text_jobs_output_and_expert_metrics(
    api: str, processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    with as_tenant(api, "alice") as alice:
        # given a worker that has built the MoE model once (a cold start exceeds 5 s)
        warm = alice.post("/v1/jobs", json={"kind": "text", "slo": "batch", "deadline_s": 120,
                                            "params": {"inputs": "warm", "max_new_tokens": 2}})
        assert warm.status_code == 201, warm.text
        wait_for(lambda: alice.get(f"/v1/jobs/{warm.json()['id']}").json()["state"] == "DONE",
                 60, "the warm-up text job")

        # when a client asks for an inference
        response = alice.post("/v1/inference", json={
            "inputs": "hello experts", "parameters": {"max_new_tokens": 4, "seed": 3}})

    # then the answer carries the text and the routing metrics of the job's JSON artifact
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["output"], str) and body["job_id"]
    assert body["metrics"]["activated_experts"] and body["metrics"]["latency_ms"] > 0
    assert 0 <= body["metrics"]["routing_score"] <= 1


def test_a_key_configured_by_its_sha256_resolves_and_a_half_configured_key_is_refused() -> None:
    digest = hash_key("a-secret-key-0123456789")
    directory = TenantDirectory(api_settings_with(key_sha256=digest, tenant="acme").api.keys)
    tenant = directory.resolve("a-secret-key-0123456789")
    assert tenant is not None and (tenant.name, tenant.tier) == ("acme", "gold")
    assert directory.resolve("a-secret-key-012345678") is None
    with pytest.raises(SettingsError, match="exactly one of 'key' or 'key_sha256'"):
        api_settings_with(tenant="acme")


def api_settings_with(**entry: object) -> Settings:
    return load_settings(api={"keys": [{"tier": "gold", **entry}]})


def test_under_overload_a_standard_tenants_job_is_shed_with_429_and_a_gold_ones_admitted(
    api: str, redis_client: redis.Redis
) -> None:
    # given the scheduler reports a load far above its shedding threshold
    redis_client.set("sl:admission", json.dumps({
        "state": "converging", "load": 50.0, "retry_after_s": 3.0,
        "measured_at_s": time.time()}))
    with as_tenant(api, "alice") as alice, as_tenant(api, "bob") as bob:
        # when a standard and a gold tenant submit
        shed = bob.post("/v1/jobs", json=simulated(slo="interactive"))
        admitted = alice.post("/v1/jobs", json=simulated(slo="interactive"))
        load = alice.get("/v1/stats").json()["load"]
    # then the tier from the key decides, and the client learns when to retry
    assert shed.status_code == 429 and "overload" in shed.json()["detail"]
    assert int(shed.headers["Retry-After"]) >= 1
    assert admitted.status_code == 201
    assert load["state"] == "converging" and load["load"] == 50.0


def test_a_batch_submit_stores_and_queues_every_job_in_order(
    api: str, redis_client: redis.Redis
) -> None:
    with as_tenant(api, "alice") as alice:
        # given a batch of jobs of every class, one with the idempotency key of an interactive
        # job submitted before
        first = alice.post("/v1/jobs", json=simulated(idempotency_key="batch-7")).json()
        jobs = [simulated(slo=slo) for slo in ("realtime", "interactive", "batch")]
        jobs.append(simulated(idempotency_key="batch-7"))
        # when it is submitted in one request
        answer = alice.post("/v1/jobs/batch", json={"jobs": jobs})
        assert answer.status_code == 201, answer.text
        entries = answer.json()["jobs"]
        # then each job has its entry, in order: three new jobs, queued on their class, and the
        # replay's first job
        assert [e["created"] for e in entries] == [True, True, True, False]
        assert entries[3]["id"] == first["id"]
        views = [alice.get(f"/v1/jobs/{e['id']}").json() for e in entries[:3]]
        assert [(v["state"], v["queue"], v["slo"]) for v in views] == [
            ("QUEUED", slo, slo) for slo in ("realtime", "interactive", "batch")]
        assert {e["error"] for e in entries} == {None}
        depths = alice.get("/v1/stats").json()["queues"]
        assert (depths["realtime"], depths["interactive"], depths["batch"]) == (1, 2, 1)


def test_a_batch_with_a_bad_job_is_refused_whole_naming_it_and_stores_nothing(
    api: str, redis_client: redis.Redis
) -> None:
    with as_tenant(api, "alice") as alice:
        before = alice.get("/v1/stats").json()["queues"]
        bad = {"kind": "simulated", "params": {"steps": 0}}
        answer = alice.post("/v1/jobs/batch", json={"jobs": [simulated(), bad, simulated()]})
        assert answer.status_code == 422, answer.text
        assert "jobs[1]" in answer.json()["detail"] and "steps" in answer.json()["detail"]
        assert alice.get("/v1/jobs").json()["jobs"] == []
        assert alice.get("/v1/stats").json()["queues"] == before
        assert alice.post("/v1/jobs/batch", json={"jobs": []}).status_code == 422


def test_a_batch_counts_every_job_against_the_rate_limit_and_the_quota(api: str) -> None:
    with as_tenant(api, "slow") as slow, as_tenant(api, "small") as small:
        # a burst of 2: a batch of 3 can never pass, one of 2 passes once, then waits
        too_big = slow.post("/v1/jobs/batch", json={"jobs": [simulated()] * 3})
        assert too_big.status_code == 422 and "burst of 2" in too_big.json()["detail"]
        assert slow.post("/v1/jobs/batch", json={"jobs": [simulated()] * 2}).status_code == 201
        limited = slow.post("/v1/jobs/batch", json={"jobs": [simulated()]})
        assert limited.status_code == 429 and "rate limit" in limited.json()["detail"]
        # a quota of 2: a batch of 3 is refused whole, a batch of 2 fits
        over = small.post("/v1/jobs/batch", json={"jobs": [simulated()] * 3})
        assert over.status_code == 429 and "this batch has 3" in over.json()["detail"]
        assert small.get("/v1/jobs").json()["jobs"] == []
        assert small.post("/v1/jobs/batch", json={"jobs": [simulated()] * 2}).status_code == 201


def test_under_overload_a_batch_reports_each_shed_job_and_keeps_the_admitted_ones(
    api: str, redis_client: redis.Redis
) -> None:
    redis_client.set("sl:admission", json.dumps({
        "state": "converging", "load": 50.0, "retry_after_s": 3.0,
        "measured_at_s": time.time()}))
    with as_tenant(api, "bob") as bob:
        answer = bob.post("/v1/jobs/batch", json={"jobs": [
            simulated(slo="realtime"), simulated(slo="interactive")]})
    assert answer.status_code == 201, answer.text
    kept, shed = answer.json()["jobs"]
    assert kept["created"] and kept["id"] and kept["error"] is None
    assert shed["id"] is None and "overload" in shed["error"] and shed["retry_after_s"] >= 1
