"""The release of an image or video chunk goes where the placement policy puts it: with
``affinity.placement: warm``, an idle worker holding its model, else its class queue."""

from __future__ import annotations

from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind
from scheduler.placement import ModelNeed, PlacementPolicy
from tasks.affinity import WorkerDirectory, needs_directory, release_queue
from tasks.heartbeat import Heartbeat
from tasks.record import JobRecord
from tasks.runtime import current_settings
from tasks.settings import Settings

QUEUES = ("realtime", "{w}.interactive", "{w}.interactive.placed", "interactive", "{w}.batch",
          "{w}.batch.placed", "batch", "{w}.standby", "standby")


def _beat(name: str, held: dict[str, int], busy: str | None = None) -> Heartbeat:
    return Heartbeat(name=name, busy_job=busy, batch=1, ts=0.0,
                     queues=tuple(q.format(w=name) for q in QUEUES),
                     residency={"device": held, "host": {}})


def _image(model: str = "dit-tiny") -> JobRecord:
    return JobRecord(
        job_id="j1", kind=JobKind.IMAGE, slo=SloClass.INTERACTIVE, tenant="acme",
        params={"model": model}, submitted_at_s=100.0, deadline_at_s=160.0, num_chunks=4,
        cost_key="image", cost_units=(1.0,) * 4, state=JobState.PENDING, queue="interactive",
        next_chunk=0, seq=0, epoch=0, updated_at_s=100.0)


def _placing(settings: Settings, placement: str) -> Settings:
    return settings.model_copy(update={"affinity": settings.affinity.model_copy(
        update={"placement": placement})})


def test_the_idle_workers_holding_the_model_are_chosen_one_per_release() -> None:
    directory = WorkerDirectory({
        "a": _beat("a", {"diffusion:dit-tiny:cpu:seeded": 900, "diffusion:pixart-tiny:cpu:s": 5}),
        "b": _beat("b", {"diffusion:dit-tiny:cpu:seeded": 900}),
        "c": _beat("c", {"diffusion:dit-tiny:cpu:seeded": 900}, busy="other"),
        "d": _beat("d", {}),
    })
    need, warm = ModelNeed("diffusion:dit-tiny"), PlacementPolicy.WARM
    assert directory.place(need, "interactive", warm).worker == "a"
    assert directory.place(need, "interactive", warm).worker == "b"  # a is taken this tick
    assert directory.place(need, "interactive", warm).worker is None  # c busy, d cold
    assert directory.place(ModelNeed("diffusion:wan-tiny"), "interactive", warm).worker is None


def test_release_queue_sends_an_image_job_to_a_warm_worker_and_else_to_its_class() -> None:
    settings = _placing(current_settings(), "warm")
    job = _image()
    assert needs_directory(settings, job)
    warm = WorkerDirectory({"b": _beat("b", {"diffusion:dit-tiny:cpu:seeded": 1})})
    assert release_queue(settings, job, "interactive", warm) == "b.interactive.placed"
    cold = WorkerDirectory({"b": _beat("b", {"diffusion:wan-tiny:cpu:seeded": 1})})
    assert release_queue(settings, job, "interactive", cold) == "interactive"
    # realtime has no affinity queue: a realtime release is never parked behind one worker
    warm = WorkerDirectory({"b": _beat("b", {"diffusion:dit-tiny:cpu:seeded": 1})})
    assert release_queue(settings, job, "realtime", warm) == "realtime"
    off = _placing(settings, "oblivious")
    assert not needs_directory(off, job)
    assert release_queue(off, job, "interactive", warm) == "interactive"
