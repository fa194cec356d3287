"""The records workers and the tick share through Redis, each with one frozen type and one codec:
the heartbeat and the admission status read back exactly, an older or partial one with defaults,
and a malformed one with an error that names what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scheduler import AdmissionStatus
from scheduler.state import AdmissionState
from tasks.admission import PublishedAdmission
from tasks.errors import AdmissionStatusError, HeartbeatError
from tasks.heartbeat import Heartbeat
from tasks.snapshot import device_loads, worker_views

pytestmark = pytest.mark.timeout(30)

WIRE_KEYS = ["name", "busy_job", "queues", "batch", "device", "ts", "chunks_run", "ckpt_cache",
             "experts", "hop_profile", "warm", "warmed"]
"""The heartbeat's JSON keys as workers write them (``expert_cache`` once used); ``warm`` and
``warmed`` came with warm start (a heartbeat without them reads as warm)."""


def busy_beat() -> Heartbeat:
    return Heartbeat(
        name="w1@host", busy_job="j1", queues=("realtime", "batch"), batch=2, device="cuda:0",
        ts=1700000000.5, chunks_run=12, ckpt_cache={"hits": 3, "misses": 1, "hit_rate": 0.75},
        experts={"qwen3-moe-tiny": {"resident": {"0": "f"}, "hot": [[0, 1, 0.5]]}},
        hop_profile={"claim": {"s": 0.01, "n": 4}}, expert_cache={"hits": 7.0, "misses": 2.0})


def test_a_heartbeat_reads_back_as_written_with_the_same_wire_keys() -> None:
    beat = busy_beat()
    wire = beat.encode()
    assert list(json.loads(wire)) == [*WIRE_KEYS, "expert_cache"]
    assert Heartbeat.decode(wire) == beat


def test_an_idle_workers_heartbeat_leaves_out_the_expert_cache_entry() -> None:
    wire = json.loads(Heartbeat(name="w2", ts=1.0).encode())
    assert list(wire) == WIRE_KEYS
    assert wire["busy_job"] is None and wire["queues"] == []


def test_a_partial_heartbeat_takes_defaults_and_its_key_names_the_worker() -> None:
    # given a heartbeat written by an older worker: no name, no caches, no profile
    beat = Heartbeat.decode(b'{"queues": ["batch"], "busy_job": null}', "w3@host")
    # then the missing entries read as defaults
    assert beat == Heartbeat(name="w3@host", queues=("batch",))
    assert beat.age_s(10.0) is None and beat.cache_counts() == {}


def test_cache_counts_are_the_entries_with_hits_and_misses() -> None:
    assert busy_beat().cache_counts() == {"ckpt_cache": (3.0, 1.0), "expert_cache": (7.0, 2.0)}


@pytest.mark.parametrize(("raw", "named"), [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"queues": "batch"}', "queues is str, not list"),
    (b'{"queues": [1]}', "queues must be a list of strings"),
    (b'{"ts": "yesterday"}', "ts is str, not a number"),
    (b'{"batch": true}', "batch is bool, not int"),
    (b'{"experts": []}', "experts is list, not dict"),
])
def test_a_malformed_heartbeat_is_an_error_naming_the_worker_and_the_entry(
    raw: bytes, named: str,
) -> None:
    with pytest.raises(HeartbeatError, match=named) as caught:
        Heartbeat.decode(raw, "w4@host")
    assert "w4@host" in str(caught.value)


def test_the_admission_status_reads_back_as_written() -> None:
    published = PublishedAdmission(state=AdmissionState.CONVERGING, load=1.25, retry_after_s=3.0,
                                   measured_at_s=100.0, policy="stepline",
                                   reserved_workers=("w1@host",))
    wire = published.encode()
    assert json.loads(wire) == {"state": "converging", "load": 1.25, "retry_after_s": 3.0,
                                "measured_at_s": 100.0, "policy": "stepline",
                                "reserved_workers": ["w1@host"]}
    assert PublishedAdmission.decode(wire) == published
    assert published.status == AdmissionStatus(AdmissionState.CONVERGING, 1.25, 3.0, 100.0)


def test_the_admission_status_carries_the_effective_and_the_compute_load() -> None:
    published = PublishedAdmission(state=AdmissionState.CONVERGING, load=1.25, retry_after_s=3.0,
                                   measured_at_s=100.0, compute_load=0.8, effective_load=1.25)
    body = json.loads(published.encode())
    assert (body["effective_load"], body["compute_load"]) == (1.25, 0.8)
    back = PublishedAdmission.decode(published.encode())
    assert back == published
    assert (back.status.effective_load, back.status.compute_load) == (1.25, 0.8)
    with pytest.raises(AdmissionStatusError, match="compute_load"):
        PublishedAdmission.decode(json.dumps({**body, "compute_load": "high"}))


def test_a_heartbeat_reports_its_device_loads_on_its_own_wall_clock() -> None:
    # the residency's clock read 500 at the heartbeat (written at wall time 10 000): a load
    # that ended at 490 on it ended 10 s before the heartbeat; a background stage is no load
    # of the device
    recent = [{"model": "m", "tier": "disk", "s": 8.0, "bytes": 1, "at": 490.0},
              {"model": "m", "tier": "stage", "s": 3.0, "bytes": 1, "at": 495.0},
              {"model": "m", "tier": "adapter", "s": 4.0, "bytes": 0, "at": 499.0}]
    beat = Heartbeat(name="w1@h", ts=10_000.0, residency={"clock": 500.0, "recent": recent})
    assert device_loads(beat) == ((9_990.0, 8.0), (9_999.0, 4.0))
    assert device_loads(replace(beat, residency={"recent": recent})) == ()  # no clock said
    (view,) = worker_views([beat])
    assert view.loads == ((9_990.0, 8.0), (9_999.0, 4.0))


def test_an_admission_status_without_policy_or_reserved_workers_still_reads() -> None:
    wire = json.dumps({"state": "open", "load": 0, "retry_after_s": 1, "measured_at_s": 5})
    assert PublishedAdmission.decode(wire) == PublishedAdmission(AdmissionState.OPEN, 0.0, 1.0,
                                                                 5.0)


@pytest.mark.parametrize(("body", "named"), [
    ("{", "not JSON"),
    ("3", "not a JSON object"),
    ('{"state": "melting", "load": 1, "retry_after_s": 1, "measured_at_s": 1}', "state"),
    ('{"state": "open", "retry_after_s": 1, "measured_at_s": 1}', "load is None"),
    ('{"state": "open", "load": "high", "retry_after_s": 1, "measured_at_s": 1}', "load"),
    ('{"state": "open", "load": 1, "retry_after_s": 1, "measured_at_s": 1, "policy": 3}',
     "policy"),
    ('{"state": "open", "load": 1, "retry_after_s": 1, "measured_at_s": 1, '
     '"reserved_workers": "w1"}', "reserved_workers"),
])
def test_a_malformed_admission_status_is_an_error_naming_the_entry(body: str, named: str) -> None:
    with pytest.raises(AdmissionStatusError, match=named):
        PublishedAdmission.decode(body)
