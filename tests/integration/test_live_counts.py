"""The live counters (unfinished jobs per state and class and per tenant, the jobs that ran) that
the Lua scripts keep on every state change equal a full count of the records after any history
of the store's writers:
submits, releases, claims, commits (hops, the last chunk, preemptions, cancels at a boundary),
client cancels, suspensions, illegal moves and failures of unreadable records. A rebuild from the
records agrees with them too."""

from __future__ import annotations

import itertools
from collections import Counter

import hypothesis
import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from app.schemas import JobSpec
from app.tenants import Tenant, TenantLimits
from scheduler.lifecycle import TERMINAL_STATES, JobState, SloClass
from tasks import keys
from tasks.live_counts import LiveCounts
from tasks.store import JobStore
from tasks.store_calls import CommitRequest
from tests.store_steps import claim_chunk, create_job

pytestmark = pytest.mark.timeout(120)

TENANTS = ("acme", "globex", "initech")


def full_count(client: redis.Redis) -> tuple[Counter[tuple[str, str]], Counter[str], set[str]]:
    """Unfinished jobs per (state, class) and per tenant, and the running jobs, from every
    record in the store."""
    by_state: Counter[tuple[str, str]] = Counter()
    by_tenant: Counter[str] = Counter()
    running: set[str] = set()
    for key in client.scan_iter(match=keys.job("*")):
        if key.count(b":") != 2:  # the job's events or checkpoint, not its record
            continue
        state, slo, tenant = (v.decode() for v in client.hmget(key, "state", "slo", "tenant"))
        if JobState(state) not in TERMINAL_STATES:
            by_state[(state, slo)] += 1
            by_tenant[tenant] += 1
        if state == JobState.RUNNING.value:
            running.add(key.decode().removeprefix(keys.job("")))
    return by_state, by_tenant, running


class LiveCountHistories(RuleBasedStateMachine):
    """Random histories of the store's writers, with the counters checked after every step."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        client.flushdb()
        self.client = client
        self.store = JobStore(client)
        self.counts = LiveCounts(client)
        self.limits = TenantLimits(client)
        self.ids: list[str] = []
        self.ever_ran: set[str] = set()
        """Jobs seen RUNNING after some step (a step moves a job once at most)."""
        self.names = itertools.count()

    def _record(self, index: int) -> tuple[str, JobState, int, int, int]:
        job_id = self.ids[index % len(self.ids)]
        r = self.store.record(job_id)
        return job_id, r.state, r.epoch, r.next_chunk, r.seq

    @rule(tenant=st.sampled_from(TENANTS), slo=st.sampled_from(list(SloClass)),
          chunks=st.integers(1, 3), replay=st.booleans())
    def submit(self, tenant: str, slo: SloClass, chunks: int, replay: bool) -> None:
        # a replayed idempotency key creates nothing, and must count nothing
        key = "same" if replay else f"k{next(self.names)}"
        spec = JobSpec(kind="simulated", slo=slo, params={"steps": chunks, "step_ms": 1},
                       idempotency_key=key)
        job_id, created = create_job(
            self.store, spec, tenant=tenant, tier="standard", num_chunks=chunks, cost_key="sim",
            cost_units=[1.0] * chunks, deadline_s=5.0, now_s=100.0, queue=slo.value)
        if created:
            self.ids.append(job_id)

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 10_000), to=st.sampled_from(list(JobState)))
    def transition(self, index: int, to: JobState) -> None:
        # any move, legal or not: an illegal one changes nothing
        job_id = self.ids[index % len(self.ids)]
        self.store.try_transition(job_id, to, by="test", reason="random move")

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 10_000))
    def claim(self, index: int) -> None:
        job_id, _, epoch, chunk, _ = self._record(index)
        claim_chunk(self.store, job_id, chunk, epoch, "w1", 5.0)

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 10_000), complete=st.booleans(), preempt=st.booleans())
    def commit(self, index: int, complete: bool, preempt: bool) -> None:
        job_id, state, epoch, chunk, seq = self._record(index)
        if preempt and state is JobState.RUNNING:
            self.store.request_preempt(job_id, state=state, epoch=epoch)
        self.store.commit(CommitRequest(job_id, chunk=chunk, epoch=epoch, seq=seq,
                                        complete=complete, checkpoint=b"c", service_s=0.01,
                                        worker="w1"))

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        # at once while waiting, at the next commit while running
        self.store.request_cancel(self.ids[index % len(self.ids)])

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 10_000))
    def fail_unreadable(self, index: int) -> None:
        self.store.fail_unreadable(self.ids[index % len(self.ids)], "unreadable")

    @invariant()
    def the_counters_equal_a_full_count(self) -> None:
        by_state, by_tenant, running = full_count(self.client)
        assert dict(self.counts.by_state().counts) == dict(by_state)
        assert self.counts.by_tenant() == dict(by_tenant)
        assert set(self.counts.running()) == running
        self.ever_ran |= running
        assert set(self.counts.ran_since(0.0)) == self.ever_ran
        for tenant in TENANTS:
            quota = Tenant(tenant, "standard", 1.0, 1, 1)
            assert self.limits.unfinished(quota) == by_tenant[tenant]

    @invariant()
    def a_rebuild_changes_nothing(self) -> None:
        before = (self.counts.by_state(), self.counts.by_tenant(), self.counts.ran_since(0.0))
        assert self.counts.rebuild() == before[0].total
        assert (self.counts.by_state(), self.counts.by_tenant(),
                self.counts.ran_since(0.0)) == before


def test_the_live_counters_equal_a_full_count_after_any_history(
        redis_client: redis.Redis) -> None:
    # given jobs of three tenants in every class; when the store's writers run in any order
    # (moves the lifecycle forbids included); then after every step the counters equal a full
    # count of the records, and rebuilding them from the records changes nothing
    class OnTheTestServer(LiveCountHistories):
        def __init__(self) -> None:
            super().__init__(redis_client)

    run_state_machine_as_test(OnTheTestServer, settings=hypothesis.settings(
        max_examples=60, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_a_rebuild_counts_a_store_written_before_the_counters(
        redis_client: redis.Redis) -> None:
    # given unfinished jobs of two tenants, and their counters lost (an older store)
    store, counts = JobStore(redis_client), LiveCounts(redis_client)
    for tenant, slo in (("a", SloClass.BATCH), ("a", SloClass.BATCH), ("b", SloClass.REALTIME)):
        create_job(store, JobSpec(kind="simulated", slo=slo, params={"steps": 1, "step_ms": 1}),
                   tenant=tenant, tier="standard", num_chunks=1, cost_key="sim",
                   cost_units=[1.0], deadline_s=5.0, now_s=100.0, queue=slo.value)
    redis_client.delete(keys.LIVE_BY_STATE, keys.LIVE_BY_TENANT)
    assert counts.by_state().total == 0
    # when they are rebuilt; then they count every unfinished job
    assert counts.rebuild() == 3
    assert counts.by_state().counts == {("PENDING", "batch"): 2, ("PENDING", "realtime"): 1}
    assert counts.by_tenant() == {"a": 2, "b": 1}
