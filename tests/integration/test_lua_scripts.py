"""Every Lua script against a real redis-server: each one survives a server that forgot its
scripts, none is sent as a plain EVAL, and the generated lifecycle tables are the Python ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from app.schemas import JobSpec
from app.tenants import Tenant, TenantLimits
from scheduler.lifecycle import TERMINAL_STATES, TRANSITIONS, JobState
from tasks import keys, scripts
from tasks.expert_updates import ExpertUpdates
from tasks.read_model import ReadModel
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tasks.tick import Lease, _hold_lease, _take_lease
from tests.store_steps import claim_with_state, create_job
from workers.moe.versions import UpdatePolicy

pytestmark = pytest.mark.timeout(60)


def _calls(client: redis.Redis) -> list[tuple[str, Callable[[], object]]]:
    """A call through each script's owner, in an order that moves one job along, and what it
    returns when the script ran."""
    store = JobStore(client)
    tenant = Tenant("t", "standard", rate_limit_per_s=10.0, burst=5, max_queued=10)
    limits = TenantLimits(client)
    spec = JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1}, idempotency_key="k")
    job_id = "?"

    def create() -> object:
        nonlocal job_id
        job_id, created = create_job(store, spec, tenant="t", tier="standard", num_chunks=2,
                                     cost_key="sim", cost_units=[1, 1], deadline_s=5,
                                     now_s=100.0, queue="interactive")
        return created

    def claim() -> object:
        record, _ = claim_with_state(store, job_id, 0, 0, "w1", 5.0)
        return not isinstance(record, str) and record.state is JobState.RUNNING

    def commit() -> object:
        return store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=0, complete=True,
                                          checkpoint=b"s", service_s=0.01, worker="w1")).status

    def first_estimate() -> object:
        store.keep_first_estimate(job_id, 1.5)
        return store.record(job_id).first_estimate_s

    def update_as_seen() -> object:
        return (store.update_as_seen(store.record(job_id), cost_key="sim-2")
                and store.record(job_id).cost_key)

    def set_fields() -> object:
        store.set_fields(job_id, level=2)
        return store.record(job_id).level

    def record_outcome() -> object:
        client.set(keys.expert_step("m"), 1)
        ExpertUpdates(client, UpdatePolicy()).record_outcome("m", "v2", 3.0, ok=True)
        return client.lrange(keys.expert_stats_prefix("m") + "1:v2", 0, -1)

    return [
        ("create", create),
        ("count_live", limits.live.rebuild),
        ("read_fields", lambda: ReadModel(store).fields([job_id, "gone"], ["tenant", "x"])),
        ("take_token", lambda: limits.take_token(tenant)),
        ("transition", lambda: store.transition(job_id, JobState.QUEUED, by="test")),
        ("first_estimate", first_estimate),
        ("claim", claim),
        ("flag_preempt", lambda: store.request_preempt(job_id, state=JobState.RUNNING, epoch=0)),
        ("commit", commit),
        ("update_as_seen", update_as_seen),
        ("set_fields", set_fields),
        ("batch_join", lambda: store.join_batch("b", job_id, 1, 0)),
        ("batch_take", lambda: store.take_joiners("b", keep=True, lease_s=5.0)),
        ("fail_unreadable", lambda: store.fail_unreadable(job_id, "unreadable")),
        ("tick_lease", lambda: _hold_lease(client, "scheduler-1", ttl_s=5.0)),
        ("record_outcome", record_outcome),
    ]


def test_every_script_runs_on_a_server_that_forgot_its_scripts_and_none_goes_as_eval(
        redis_client: redis.Redis) -> None:
    # given a call through the owner of each script, and a server counting its commands
    calls = _calls(redis_client)
    assert sorted(name for name, _ in calls) == scripts.script_names()
    redis_client.config_resetstat()
    outcomes = {}
    for name, call in calls:
        # when the server flushes its script cache right before each call
        redis_client.script_flush()
        outcomes[name] = call()
    # then each call ran its script (loaded again) and did its work
    assert outcomes["create"] is True and outcomes["count_live"] == 1
    assert outcomes["read_fields"] == [[b"t", None], [None, None]]
    assert outcomes["take_token"] == 0.0 and outcomes["transition"] is True
    assert outcomes["first_estimate"] == 1.5
    assert outcomes["claim"] is True and outcomes["flag_preempt"] is True
    assert outcomes["commit"] is CommitStatus.PREEMPTED  # the flag stopped it at the boundary
    assert outcomes["update_as_seen"] == "sim-2" and outcomes["set_fields"] == 2
    assert outcomes["batch_join"] is False
    assert outcomes["batch_take"] == [] and outcomes["fail_unreadable"] is True
    assert outcomes["tick_lease"] is True and outcomes["record_outcome"] == [b"1:3.0000"]
    # and every script went as EVALSHA, never as a plain EVAL
    stats = redis_client.info("commandstats")
    assert "cmdstat_evalsha" in stats and "cmdstat_eval" not in stats


def test_the_lifecycle_tables_the_scripts_see_are_the_python_ones(
        redis_client: redis.Redis) -> None:
    # given the generated prelude, read back out of Redis's Lua
    probe = scripts.lifecycle_prelude() + """
local terminal, moves = {}, {}
for state in pairs(TERMINAL) do table.insert(terminal, state) end
for target, sources in pairs(SOURCES) do
  for source in pairs(sources) do table.insert(moves, source .. '>' .. target) end
end
local misspelt_is_nil = pcall(function() return STATE.RUNING end)
return {terminal, moves, STATE.RUNNING, misspelt_is_nil and 1 or 0}
"""
    terminal, moves, running, typo = redis_client.eval(probe, 0)
    # then it holds the terminal states and the legal moves of scheduler.lifecycle
    assert {t.decode() for t in terminal} == {s.value for s in TERMINAL_STATES}
    assert {m.decode() for m in moves} == {f"{s.value}>{t.value}" for s, targets in
                                           TRANSITIONS.items() for t in targets}
    # and a state name misspelt in a script is an error, not nil
    assert running == b"RUNNING" and typo == 0


def test_a_scheduler_that_takes_back_its_own_lapsed_lease_keeps_its_snapshot(
    redis_client: redis.Redis,
) -> None:
    # given scheduler a holding the tick lease
    assert _take_lease(redis_client, "a", ttl_s=5.0) is Lease.TAKEN
    assert _take_lease(redis_client, "a", ttl_s=5.0) is Lease.RENEWED
    assert _take_lease(redis_client, "b", ttl_s=5.0) is Lease.OTHER
    # when its lease lapses inside a long tick and nobody else takes it, it takes it back as
    # its own (its kept snapshot is still good: nobody else has ticked)
    redis_client.delete(keys.TICK_LEASE)
    assert _take_lease(redis_client, "a", ttl_s=5.0) is Lease.RENEWED
    # but once another scheduler took a lapsed lease, each of them takes it afresh
    redis_client.delete(keys.TICK_LEASE)
    assert _take_lease(redis_client, "b", ttl_s=5.0) is Lease.TAKEN
    redis_client.delete(keys.TICK_LEASE)
    assert _take_lease(redis_client, "a", ttl_s=5.0) is Lease.TAKEN
