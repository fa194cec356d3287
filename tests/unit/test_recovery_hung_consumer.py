"""A hung consumer's work, pure: a published message that an idle live worker consuming its
queue has not taken is held by a consumer that stopped (SIGSTOP, a frozen host) and is published
again under a new epoch; a chunk parked on a worker whose heartbeat lapsed always moves; the
tick's plan carries the recovery and no other action on the job."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import JobState, PolicyConfig, plan_tick
from scheduler.cost import CostModel
from scheduler.model import WorkerView
from scheduler.queues import NORMAL_WORKER_QUEUES
from scheduler.recovery import RecoveryCause, RecoveryConfig, plan_recoveries
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot

pytestmark = pytest.mark.timeout(60)

LEASE_S = 1.5
CONFIG = RecoveryConfig(unpublished_after_s=LEASE_S, unclaimed_after_s=LEASE_S,
                        claim_within_s=0.5, affinity_max_wait_s=0.3)


def _queued(job_id: str, waited_s: float, **kw: object) -> object:
    fields: dict[str, object] = {"state": JobState.QUEUED, "queue": "interactive",
                                 "waiting_since_s": NOW_S - waited_s, "next_chunk": 2,
                                 "epoch": 1, "published": (2, 1)}
    fields.update(kw)
    return make_job(job_id, **fields)  # type: ignore[arg-type]


def _idle(name: str, since_s: float, seen_ago_s: float = 0.1,
          queues: tuple[str, ...] = NORMAL_WORKER_QUEUES) -> WorkerView:
    return WorkerView(name, True, None, queues, "cpu", idle_since_s=since_s,
                      seen_at_s=NOW_S - seen_ago_s)


def _causes(jobs: list[object], workers: tuple[WorkerView, ...],
            config: RecoveryConfig = CONFIG) -> dict[str, RecoveryCause]:
    alive = frozenset(w.name for w in workers if w.alive)
    recoveries, _ = plan_recoveries(jobs, alive, CostModel(), config, NOW_S,  # type: ignore[arg-type]
                                    workers)
    return {r.job_id: r.cause for r in recoveries}


def test_a_published_message_an_idle_worker_never_took_is_published_again() -> None:
    # given a job queued 2 s ago (its message published then) and a worker idle on its queue
    # since before it was queued
    job = _queued("a", waited_s=2.0)
    witness = _idle("w1", since_s=NOW_S - 10.0)
    # then the message is held elsewhere: a hung consumer took it
    assert _causes([job], (witness,)) == {"a": RecoveryCause.UNCLAIMED}


def test_no_message_is_judged_unclaimed_within_the_heartbeat_timeout() -> None:
    job = _queued("a", waited_s=LEASE_S - 0.1)
    assert _causes([job], (_idle("w1", since_s=NOW_S - 10.0),)) == {}


def test_a_worker_busy_or_idle_only_briefly_witnesses_nothing() -> None:
    job = _queued("a", waited_s=5.0)
    busy = WorkerView("w1", True, "other", NORMAL_WORKER_QUEUES, "cpu",
                      idle_since_s=None, seen_at_s=NOW_S - 0.1)
    just_idle = _idle("w2", since_s=NOW_S - 0.3)  # idle 0.2 s as of its heartbeat
    unsaid = WorkerView("w3", True, None, NORMAL_WORKER_QUEUES, "cpu")  # an older worker
    assert _causes([job], (busy, just_idle, unsaid)) == {}
    # idle long enough, as of a heartbeat written well after the job was queued: it witnesses
    assert _causes([job], (busy, _idle("w2", since_s=NOW_S - 0.7))) == {
        "a": RecoveryCause.UNCLAIMED}


def test_idleness_counts_only_from_when_the_job_was_queued() -> None:
    # the worker's last heartbeat, 0.3 s after the job was queued, is too soon to witness
    job = _queued("a", waited_s=2.0)
    early = _idle("w1", since_s=NOW_S - 10.0, seen_ago_s=1.7)
    assert _causes([job], (early,)) == {}


def test_only_a_worker_that_consumes_the_jobs_queue_witnesses() -> None:
    job = _queued("a", waited_s=5.0)
    reserved = _idle("w1", since_s=NOW_S - 10.0, queues=("realtime",))
    assert _causes([job], (reserved,)) == {}
    on_standby = replace(job, queue="standby")
    assert _causes([on_standby], (_idle("w2", since_s=NOW_S - 10.0),)) == {
        "a": RecoveryCause.UNCLAIMED}


def test_unpublished_joiners_and_parked_chunks_are_left_to_their_own_rules() -> None:
    witness = _idle("w1", since_s=NOW_S - 10.0)
    unpublished = _queued("u", waited_s=5.0, published=(1, 1))
    joiner = _queued("j", waited_s=5.0, batch_id="b1", published=(-1, -1))
    parked = _queued("p", waited_s=0.1, parked_on="w1")  # w1 takes its own queue's chunks
    running = make_job("r", state=JobState.RUNNING, running_on="w0",
                       lease_until_s=NOW_S + 1.0, chunk_running_since_s=NOW_S - 5.0)
    assert _causes([unpublished, joiner, parked, running], (witness,)) == {
        "u": RecoveryCause.UNPUBLISHED, "j": RecoveryCause.UNPUBLISHED}


def test_a_chunk_parked_on_a_worker_whose_heartbeat_lapsed_moves_even_with_affinity_off() -> None:
    job = _queued("p", waited_s=0.05, parked_on="w9")  # w9: no heartbeat (dead, or hung)
    off = replace(CONFIG, affinity_max_wait_s=None)
    live = (_idle("w1", since_s=NOW_S - 10.0),)
    assert _causes([job], live) == {"p": RecoveryCause.PARKED}
    assert _causes([job], live, off) == {"p": RecoveryCause.PARKED}
    # while its worker is alive, affinity off leaves the parked chunk to its worker
    assert _causes([replace(job, parked_on="w1")], live, off) == {}


def test_the_tick_plans_the_recovery_and_nothing_else_for_the_job() -> None:
    job = _queued("a", waited_s=3.0)
    snapshot = make_snapshot([job], workers=1)  # type: ignore[list-item]
    snapshot = replace(snapshot, workers=(_idle("w0", since_s=NOW_S - 10.0),))
    plan = plan_tick(snapshot, PolicyConfig(recovery=CONFIG), NOW_S)
    assert [(r.job_id, r.cause) for r in plan.recoveries] == [("a", RecoveryCause.UNCLAIMED)]
    acted = {*(r.job_id for r in plan.releases), *(r.job_id for r in plan.requeues),
             *plan.preempt, *plan.standby, *plan.suspend}
    assert "a" not in acted


def test_a_heartbeat_says_since_when_it_is_idle_and_an_older_one_says_nothing() -> None:
    from tasks.heartbeat import Heartbeat
    from tasks.snapshot import worker_views

    idle = Heartbeat(name="w1@h", queues=("interactive",), ts=NOW_S, idle_since=NOW_S - 4.0)
    assert Heartbeat.decode(idle.encode()) == idle
    older = Heartbeat.decode('{"name": "w2@h", "queues": ["interactive"], "ts": 1000.0}')
    warming = replace(idle, name="w3@h", warm=False)
    views = {v.name: v for v in worker_views([idle, older, warming])}
    assert views["w1@h"].idle_over_s(NOW_S - 1.0) == pytest.approx(1.0)
    assert views["w2@h"].idle_over_s(NOW_S - 1.0) == 0.0
    assert views["w3@h"].idle_over_s(NOW_S - 1.0) == 0.0
