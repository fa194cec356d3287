"""The tick applies its plan in pipelined batches: a convergence tick that suspends and levels
thousands of jobs costs a few round trips to a real redis-server, each action still fenced on
the record the tick saw; and the next tick reads none of the records only the tick wrote."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import pytest
import redis
from redis.connection import AbstractConnection

from scheduler import PolicyConfig, plan_tick
from scheduler.lifecycle import JobState
from scheduler.plan import LevelMark
from tasks import scripts
from tasks.adapter import APPLY_BATCH, LiveTarget
from tasks.apply import apply_plan
from tasks.settings import Settings
from tasks.snapshot import SnapshotCache, read_snapshot
from tasks.spec import JobSpec
from tasks.store import JobStore
from tests.store_steps import create_job, renew_lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOBS = 1200
MOVED = 40
"""Jobs cancelled between the tick's read and its apply: their actions must be refused."""


class RoundTrips:
    """Counts what the client sends: one ``send_packed_command`` per command or pipeline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        send = AbstractConnection.send_packed_command

        def counting(conn: AbstractConnection, command: Any, check_health: bool = True
                     ) -> None:
            self.count += 1
            send(conn, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)


def _world(client: redis.Redis, jobs: int) -> tuple[JobStore, list[str]]:
    store = JobStore(client)
    spec = JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1})
    ids = [create_job(store, spec, tenant="t", tier="standard", num_chunks=2, cost_key="sim",
                           cost_units=[1.0, 1.0], deadline_s=600, now_s=time.time(),
                           queue="batch")[0] for _ in range(jobs)]
    return store, ids


def _convergence(store: JobStore, ids: list[str], cache: SnapshotCache | None = None
                 ) -> tuple[Any, Any]:
    """The tick's read (from ``cache`` when given), and a plan that suspends and levels every
    job it saw."""
    policy = PolicyConfig()
    seen = (cache.read(policy.new_cost_model(), policy, time.time()) if cache is not None
            else read_snapshot(store, policy.new_cost_model(), policy, time.time()))
    plan = plan_tick(seen.snapshot, policy, time.time())
    plan = replace(plan, releases=(), requeues=(), retargets=(), preempt=(), standby=(),
                   expire=(), recoveries=(), failures=(), estimates=None,
                   suspend=tuple(ids),
                   levels={job_id: LevelMark(level=1, service_mark_s=0.0) for job_id in ids},
                   worker_queues={})
    return seen, plan


@pytest.mark.parametrize("buffered", [True, False])
def test_a_convergence_tick_costs_a_few_round_trips_and_stays_fenced(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, buffered: bool) -> None:
    # given a tick's read of many waiting jobs, a plan suspending and levelling all of them,
    # and some jobs cancelled since the read
    store, ids = _world(redis_client, JOBS)
    seen, plan = _convergence(store, ids)
    for job_id in ids[:MOVED]:
        store.request_cancel(job_id)
    # when the plan is applied (on a server that has its scripts: a first call loads one),
    # counting what the client sends
    for name in ("transition", "set_fields"):
        redis_client.script_load(scripts.source(name))
    trips = RoundTrips(monkeypatch)
    target = LiveTarget(store, seen.records, Settings(), buffered=buffered)
    apply_plan(plan, target)
    target.flush()
    # then buffered: a round trip per APPLY_BATCH actions, plus the worker queues and the
    # decisions; unbuffered: at least one per action
    actions = 2 * JOBS
    if buffered:
        assert trips.count <= math.ceil(actions / APPLY_BATCH) + 2, trips.count
        assert not any(target.moved[job_id] for job_id in ids[:MOVED])
        assert all(target.moved[job_id] for job_id in ids[MOVED:])
    else:
        assert trips.count >= actions
    # and every job the tick saw as it is was suspended; the cancelled ones were left alone
    records = {r.job_id: r for r in store.records(ids) if not isinstance(r, Exception)}
    assert all(records[j].state is JobState.CANCELLED for j in ids[:MOVED])
    assert all(records[j].state is JobState.SUSPENDED for j in ids[MOVED:])
    assert all(records[j].level == 1 for j in ids)


def test_the_next_tick_reads_none_of_its_own_writes_but_each_one_written_by_another(
        redis_client: redis.Redis) -> None:
    # given a tick's cached read of many waiting jobs and a plan suspending and levelling all
    store, ids = _world(redis_client, 300)
    cache = SnapshotCache(store)
    seen, plan = _convergence(store, ids, cache)
    # when a worker writes one record between the tick's read and its apply (the tick's fences
    # on state, epoch and seq still pass), the tick applies and folds its own writes, and
    # another worker writes a second record right after
    store.set_fields(ids[0], expert_version="v2")
    target = LiveTarget(store, seen.records, Settings(), buffered=True)
    apply_plan(plan, target)
    target.flush()
    assert len(target.written) == 2 * len(ids)
    cache.fold_written(target.written)
    renew_lease(store, ids[1], 30.0)
    # then the next tick reads exactly those two records again, and holds what a full read does
    policy = PolicyConfig()
    now = time.time()
    folded = cache.read(policy.new_cost_model(), policy, now)
    assert (cache.full_reads, cache.changed) == (1, 2)
    full = read_snapshot(store, policy.new_cost_model(), policy, now)
    assert folded.records == full.records and folded.snapshot.jobs == full.snapshot.jobs
    assert folded.records[ids[0]].expert_version == "v2"
    assert all(r.state is JobState.SUSPENDED and r.level == 1 for r in folded.records.values())
