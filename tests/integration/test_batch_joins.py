"""The batch join protocol on a real redis-server, in every order (hypothesis stateful): the
tick's joins and a batch's steps and end interleaved; no accepted join is ever lost or taken
twice, and a refused join is the caller's to publish."""

from __future__ import annotations

import hypothesis
import pytest
import redis
from hypothesis import HealthCheck
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tasks import keys
from tasks.store import JobStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LEASE_S = 30.0


class BatchJoins(RuleBasedStateMachine):
    """One batch's life, again and again: opened by a publish, joined by the tick, stepped and
    ended by its worker; its open mark may also lapse (a dead worker's batch)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        self.store = JobStore(client)
        self.batch = "0123456789abcdef.000001"
        client.delete(keys.batch_open(self.batch), keys.batch_joins(self.batch))
        self.next_job = 0
        self.accepted: list[str] = []
        self.refused: list[str] = []
        self.taken: list[str] = []
        self.closed_by_worker = False

    @rule()
    def publish_opens_the_batch(self) -> None:
        self.store.redis.set(keys.batch_open(self.batch), "1", px=int(LEASE_S * 1000))
        self.closed_by_worker = False

    @rule()
    def the_tick_joins_a_job(self) -> None:
        job_id = f"{self.next_job:016x}"
        self.next_job += 1
        if self.store.join_batch(self.batch, job_id, 3, 1):
            self.accepted.append(job_id)
        else:
            self.refused.append(job_id)  # the tick publishes it on its own

    @rule()
    def a_step_takes_the_joiners(self) -> None:
        # (a step of a batch that had ended — a late duplicate of its message — opens it again;
        # that step, too, ends with a take that closes it or goes on)
        self._take(keep=True)
        self.closed_by_worker = False

    @rule()
    def the_last_step_ends_the_batch(self) -> None:
        self._take(keep=False)
        self.closed_by_worker = True

    @rule()
    def the_open_mark_lapses(self) -> None:
        self.store.redis.delete(keys.batch_open(self.batch))

    def _take(self, keep: bool) -> None:
        joiners = self.store.take_joiners(self.batch, keep=keep, lease_s=LEASE_S)
        assert all((chunk, epoch) == (3, 1) for _, chunk, epoch in joiners)
        self.taken.extend(job_id for job_id, _, _ in joiners)

    @invariant()
    def every_accepted_join_is_taken_once_or_still_waiting(self) -> None:
        waiting = [raw.decode() for raw in
                   self.store.redis.lrange(keys.batch_joins(self.batch), 0, -1)]
        pending = [j for j in self.accepted if j not in self.taken]
        assert len(self.taken) == len(set(self.taken)), "a joiner was taken twice"
        assert set(self.taken) <= set(self.accepted)
        assert not set(self.accepted) & set(self.refused)
        assert [f'["{j}", 3, 1]' for j in pending] == waiting

    @invariant()
    def a_batch_its_worker_ended_holds_no_joiner(self) -> None:
        if self.closed_by_worker:
            assert not self.store.redis.exists(keys.batch_open(self.batch))
            assert not self.store.redis.llen(keys.batch_joins(self.batch))


def test_no_interleaving_of_joins_and_steps_loses_or_repeats_a_joiner(
    redis_client: redis.Redis,
) -> None:
    class OnTheTestServer(BatchJoins):
        def __init__(self) -> None:
            super().__init__(redis_client)

    run_state_machine_as_test(
        OnTheTestServer,
        settings=hypothesis.settings(max_examples=150, stateful_step_count=30, deadline=None,
                                     database=None,
                                     suppress_health_check=[HealthCheck.too_slow]),
    )
