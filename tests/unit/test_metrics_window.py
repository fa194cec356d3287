"""The figures /v1/stats, /metrics and the dashboard share: per-class attainment over the sliding
window, and the age of a queue's oldest waiting message read back from kombu's stored JSON."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from app.api.stats import (
    ChunkRef,
    chunk_of,
    chunk_queued_at_s,
    experts_resident,
    expiring_sent_at_s,
    model_residency,
    parse_message,
    window_class_stats,
)
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind
from tasks.heartbeat import Heartbeat
from tasks.record import JobRecord

pytestmark = pytest.mark.timeout(30)


def kombu_message(task: str, args: list[Any], **headers: Any) -> bytes:
    """A message as kombu's Redis transport stores it for Celery (protocol 2, base64 body)."""
    body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None,
                                  "chord": None}])
    expiration = headers.pop("expiration", None)
    properties: dict[str, Any] = {"delivery_mode": 2, "priority": 0, "body_encoding": "base64",
                                  "delivery_info": {"exchange": "", "routing_key": "batch"},
                                  "delivery_tag": "tag"}
    if expiration is not None:
        properties["expiration"] = expiration
    return json.dumps({
        "body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": task, "id": "x", "eta": None, "expires": None,
                    **headers},
        "properties": properties,
    }).encode()


def record(job_id: str, slo: SloClass, state: JobState, latency_s: float,
           deadline_s: float) -> JobRecord:
    return JobRecord(job_id=job_id, kind=JobKind.SIMULATED, slo=slo, tenant="t", params={},
                     submitted_at_s=100.0, deadline_at_s=100.0 + deadline_s, num_chunks=1,
                     cost_key="simulated", cost_units=(1.0,), state=state, next_chunk=1, seq=1,
                     epoch=0, queue=slo.value, updated_at_s=100.0 + latency_s,
                     finished_at_s=100.0 + latency_s)


def test_a_chunk_message_reads_back_as_its_job_chunk_and_epoch() -> None:
    # given messages as kombu stores them
    chunk = parse_message(kombu_message("stepline.chunk", ["0123abcd", 4, 2]))
    tick = parse_message(kombu_message("scheduler.tick", []))

    # then the chunk task's arguments come back, and anything else is not a chunk
    assert chunk is not None and chunk_of(chunk) == ChunkRef("0123abcd", 4, 2)
    assert tick is not None and chunk_of(tick) is None
    assert parse_message(b"not json") is None
    broken = parse_message(kombu_message("stepline.chunk", ["only-an-id"]))
    assert broken is not None and chunk_of(broken) is None


def test_a_chunk_message_is_dated_by_its_record_only_while_the_job_waits_for_that_chunk() -> None:
    ref = ChunkRef("j", chunk=3, epoch=1)

    def fields(state: str, epoch: int, next_chunk: int) -> list[bytes | None]:
        return [state.encode(), str(epoch).encode(), str(next_chunk).encode(), b"1000.5"]

    # a job QUEUED for exactly this chunk and epoch: the record's queued-at time
    assert chunk_queued_at_s(ref, fields("QUEUED", 1, 3)) == 1000.5
    # a requeue bumped the epoch, the job moved on, is running or ended: a stale message
    assert chunk_queued_at_s(ref, fields("QUEUED", 2, 3)) is None
    assert chunk_queued_at_s(ref, fields("QUEUED", 1, 4)) is None
    assert chunk_queued_at_s(ref, fields("RUNNING", 1, 3)) is None
    assert chunk_queued_at_s(ref, fields("DONE", 1, 3)) is None
    # a job that is gone
    assert chunk_queued_at_s(ref, [None, None, None, None]) is None


def test_a_message_with_an_expiry_is_dated_from_it() -> None:
    # given a tick message sent at t, expiring 200 ms later
    sent = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    expires = datetime.fromtimestamp(sent + 0.2, tz=UTC).isoformat()
    message = parse_message(kombu_message("scheduler.tick", [], expires=expires,
                                          expiration="200"))

    # then its send time is the expiry less the time to live
    assert message is not None and expiring_sent_at_s(message) == pytest.approx(sent)
    plain = parse_message(kombu_message("scheduler.tick", []))
    assert plain is not None and expiring_sent_at_s(plain) is None


def test_the_window_counts_ended_jobs_per_class_with_their_latency_percentiles() -> None:
    # given realtime jobs: 3 met their 1 s deadline, 1 was late, 1 failed; one batch job met
    jobs = [record(f"r{i}", SloClass.REALTIME, JobState.DONE, 0.2 * (i + 1), 1.0)
            for i in range(3)]
    jobs += [record("late", SloClass.REALTIME, JobState.DONE, 2.0, 1.0),
             record("failed", SloClass.REALTIME, JobState.FAILED, 0.1, 1.0),
             record("b", SloClass.BATCH, JobState.DONE, 30.0, 60.0)]

    # when the window's figures are computed
    stats = window_class_stats(jobs)

    # then each class has its own attainment and latency percentiles over its DONE jobs
    realtime = stats["realtime"]
    assert (realtime.finished, realtime.met, realtime.attainment) == (5, 3, 0.6)
    # DONE latencies 0.2, 0.4, 0.6, 2.0, interpolated linearly (positions 1.5 and 2.85)
    assert realtime.p50_latency_s == pytest.approx(0.5)
    assert realtime.p95_latency_s == pytest.approx(0.6 + 0.85 * 1.4)
    assert (stats["batch"].finished, stats["batch"].attainment) == (1, 1.0)
    assert stats["batch"].p95_latency_s == pytest.approx(30.0)
    interactive = stats["interactive"]
    assert (interactive.finished, interactive.attainment, interactive.p95_latency_s) == (
        0, None, None)


def test_experts_resident_counts_the_bits_of_each_layers_residency_mask() -> None:
    beat = Heartbeat.decode(json.dumps({
        "name": "w1", "experts": {"qwen3-moe-tiny": {"resident": {"0": "f", "1": "101", "2": "0"},
                                                     "hot": []},
                                  "broken": "nonsense", "odd": {"resident": {"0": "zz"}}}}))
    assert experts_resident(beat) == {"qwen3-moe-tiny": 4 + 2}
    assert experts_resident(Heartbeat(name="w2")) == {}


def test_the_models_a_worker_holds_are_read_from_its_heartbeats_residency() -> None:
    beat = Heartbeat.decode(json.dumps({"name": "w1", "residency": {
        "device": {"simulated:m1": 300, "simulated:m0": 200}, "host": {"simulated:m2": 100},
        "staging": ["simulated:m3"], "budget_bytes": 1000, "loads": {"disk": 3, "host": 1},
        "load_s": {"disk": 1.25, "host": 0.25}, "adapter_loads": 2, "staged": 1}}))
    assert model_residency(beat) == {
        "device": ["simulated:m0", "simulated:m1"], "host": ["simulated:m2"],
        "staging": ["simulated:m3"], "device_bytes": 500, "budget_bytes": 1000, "loads": 4,
        "load_s": 1.5, "adapter_loads": 2, "staged": 1, "loading": None}
    loading = Heartbeat.decode(json.dumps({"name": "w1", "residency": {
        "loading": {"model": "simulated:m4", "since": 12.5, "expected_s": 2.0, "from": "disk"}}}))
    assert model_residency(loading)["loading"] == {
        "model": "simulated:m4", "since": 12.5, "expected_s": 2.0, "from": "disk"}
    assert model_residency(Heartbeat(name="w2")) == {}  # no runner built yet
    odd = Heartbeat.decode(json.dumps({"name": "w3", "residency": {"loads": {"disk": "x"}}}))
    assert model_residency(odd) == {}  # another version's: left out, not an error
