"""The live snapshot writes every ``JobView`` field the planner reads: a field left at its default
by ``tasks.snapshot.job_view`` would make the live tick plan differently from the simulator."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields, replace
from pathlib import Path

import pytest

from scheduler import JobKind, JobState, JobView, ResourceProfile, SloClass, Tier
from tasks.record import JobRecord
from tasks.snapshot import block_groups, job_view

pytestmark = pytest.mark.timeout(30)

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"


def _read_by_the_scheduler() -> set[str]:
    """JobView fields some scheduler module other than the one defining them reads."""
    source = "\n".join(p.read_text() for p in SCHEDULER.glob("*.py") if p.name != "model.py")
    return {f.name for f in fields(JobView) if re.search(rf"\.{f.name}\b", source)}


def _live_record(**overrides: object) -> JobRecord:
    """A RUNNING simulated job on a worker's affinity queue with every fact set away from its
    default."""
    values: dict[str, object] = dict(
        job_id="j1", kind=JobKind.SIMULATED, slo=SloClass.INTERACTIVE, tenant="acme",
        params={"steps": 4, "step_ms": 10.0, "block_groups": 3, "batch_growth": 0.3,
                "model": "m1"},
        submitted_at_s=100.0, deadline_at_s=160.0, num_chunks=4, cost_key="simulated",
        cost_units=(1.0, 2.0, 3.0, 4.0), state=JobState.RUNNING, next_chunk=1, seq=2, epoch=3,
        queue="w1.batch", updated_at_s=110.0, tier=Tier.GOLD, depends_on=("j0",),
        chunk_names=("step[0]", "step[1]", "step[2]", "step[3]"),
        resource_profile=ResourceProfile.MEMORY, shed_if_late=True, preempt=True,
        preemptions=2, service_s=4.5, running_on="w1@host", chunk_started_at_s=112.0,
        lease_until_s=130.0, last_task_id="j1.1.3.x", queued_at_s=108.0, level=1,
        level_mark_s=1.5, stuck=1, first_estimate_s=9.0, batch_group="sim:10",
        batch="b1", batch_growth=0.3,
    )
    values.update(overrides)
    return JobRecord(**values)  # type: ignore[arg-type]


def test_every_field_the_planner_reads_is_written_by_the_live_snapshot() -> None:
    # given a live record whose every fact differs from a fresh job's
    read = _read_by_the_scheduler()
    assert {"block_groups", "deadline_s", "remaining_units_by_key", "batch_growth"} <= read
    # when the snapshot turns it into the policy's view
    view = job_view(_live_record(), failed_dependency="dependency j0 ended FAILED",
                    own_s_per_unit=0.02)
    # then no field the planner reads is left at its dataclass default, but a cold job's
    # expected load (``load_s``), whether its parked chunk's worker evicted its model
    # (``model_left``) and whether an idle worker holds it (``idle_holder``): the tick sets
    # them after the read, from the workers' residency (``tasks.load_estimates.ExpectedLoads``,
    # tested in test_live_placement)
    not_yet = {"load_s", "model_left", "idle_holder"}
    left = [f.name for f in fields(JobView) if f.name in read and f.default is not MISSING
            and getattr(view, f.name) == f.default and f.name not in not_yet]
    assert left == []


def test_block_groups_follow_where_each_runner_can_stop_its_chunk() -> None:
    # a simulated step sleeps in its own slices
    assert block_groups(_live_record(), 2) == 3
    # a denoise step runs in the workers' block groups; encode and VAE decode run whole
    names = ("encode", "denoise[0]", "denoise[1]", "decode")
    image = _live_record(kind=JobKind.IMAGE, chunk_names=names, params={"model": "dit-tiny"})
    assert [block_groups(replace(image, next_chunk=k), 4) for k in range(4)] == [1, 4, 4, 1]
    # a text decode chunk can stop before each of its tokens; the prefill runs whole
    text = _live_record(kind=JobKind.TEXT, chunk_names=("prefill", "decode[0]", "decode[1]",
                                                        "decode[2]"),
                        params={"chunk_tokens": 8})
    assert block_groups(replace(text, next_chunk=0), 2) == 1
    assert block_groups(text, 2) == 8


def test_a_preempted_job_waits_from_its_preemption_not_from_its_last_queueing() -> None:
    # given a job whose chunk was queued at 108 s (a hop onto standby), ran, and was
    # preempted at its end at 115 s
    preempted = _live_record(state=JobState.PREEMPTED, queued_at_s=108.0, preempted_at_s=115.0,
                             running_on=None, preempt=False)
    # when the snapshot views it, then it has waited since its preemption, as the simulator
    # counts it: not since the queueing its chunk has long left
    assert job_view(preempted).waiting_since_s == 115.0
    # and released again at 120 s, it waits from that release
    released = replace(preempted, state=JobState.QUEUED, queued_at_s=120.0)
    assert job_view(released).waiting_since_s == 120.0
    # and a job never queued nor preempted waits from its submit
    fresh = replace(preempted, state=JobState.PENDING, queued_at_s=None, preempted_at_s=None)
    assert job_view(fresh).waiting_since_s == 100.0
