"""Degradation before shedding (``scheduler.degradation``): a job that gave a floor runs at
fewer steps only under overload and only when its full quality is predicted late; never below
its floor, never without one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.degradation import Level, QualityLadder, choose_level, choose_steps, stretch
from scheduler.policy import PolicyConfig

POLICY = PolicyConfig()

ladders = st.builds(
    lambda full, floor_share, step_s, fixed_s: QualityLadder(
        full_steps=full, min_steps=max(1, round(floor_share * full)), step_s=step_s,
        fixed_s=fixed_s),
    st.integers(1, 200), st.floats(0.0, 1.0), st.floats(1e-3, 10.0), st.floats(0.0, 20.0))
loads = st.floats(0.0, 5.0)
deadlines = st.floats(0.1, 10_000.0)


@given(ladders, deadlines, loads)
def test_a_degraded_job_runs_between_its_floor_and_fewer_steps_than_it_asked(
        ladder: QualityLadder, deadline_s: float, load: float) -> None:
    # given any job with a floor, deadline and load
    # when admission chooses its level
    chosen = choose_steps(ladder, deadline_s, load, POLICY)
    # then a degraded job keeps at least its floor and loses at least one step
    if chosen is not None:
        assert ladder.min_steps <= chosen.steps < ladder.full_steps == chosen.full_steps
        assert "degraded to" in chosen.reason and f"{chosen.steps} of" in chosen.reason


@given(ladders, deadlines, st.floats(0.0, 1.0))
def test_no_job_is_degraded_at_or_below_the_degrade_load(
        ladder: QualityLadder, deadline_s: float, load: float) -> None:
    # given a load that is not past degrade_load (1.0 by default)
    # then no job is degraded, however late it would be
    assert choose_steps(ladder, deadline_s, load, POLICY) is None


@given(st.integers(1, 200), st.floats(1e-3, 10.0), deadlines, loads)
def test_a_job_whose_floor_is_its_own_steps_is_never_degraded(
        steps: int, step_s: float, deadline_s: float, load: float) -> None:
    # given a job that allows nothing below what it asked
    ladder = QualityLadder(full_steps=steps, min_steps=steps, step_s=step_s)
    # then it runs as asked
    assert choose_steps(ladder, deadline_s, load, POLICY) is None


@given(ladders, deadlines, loads)
def test_a_job_predicted_on_time_at_full_quality_keeps_it(
        ladder: QualityLadder, deadline_s: float, load: float) -> None:
    # given a job whose full quality is predicted to make its deadline
    if stretch(load) * ladder.work_s(ladder.full_steps) > deadline_s:
        return
    # then it is not degraded
    assert choose_steps(ladder, deadline_s, load, POLICY) is None


@given(ladders, deadlines, loads)
def test_the_level_chosen_is_the_most_steps_predicted_on_time_or_the_floor(
        ladder: QualityLadder, deadline_s: float, load: float) -> None:
    # when a job is degraded
    chosen = choose_steps(ladder, deadline_s, load, POLICY)
    if chosen is None:
        return
    predicted = lambda k: stretch(load) * ladder.work_s(k)  # noqa: E731
    # then one more step would be predicted late, and the level is on time unless it is the
    # floor
    assert predicted(chosen.steps + 1) > deadline_s * (1 - 1e-9)
    assert chosen.steps == ladder.min_steps or predicted(chosen.steps) <= deadline_s * (1 + 1e-9)
    # and it says it meets the deadline exactly when its level is predicted on time (a job
    # that meets it is admitted where it would have been shed)
    on_time = predicted(chosen.steps) <= deadline_s * (1 + 1e-9)
    late = predicted(chosen.steps) > deadline_s * (1 - 1e-9)
    assert (chosen.meets or late) and (not chosen.meets or on_time)


@given(ladders, deadlines, loads, loads)
def test_more_load_never_buys_a_job_more_steps(
        ladder: QualityLadder, deadline_s: float, a: float, b: float) -> None:
    # given the same job at two loads
    low, high = sorted((a, b))
    steps = [ladder.full_steps if (c := choose_steps(ladder, deadline_s, load, POLICY)) is None
             else c.steps for load in (low, high)]
    # then the higher load runs it at no more steps
    assert steps[1] <= steps[0]


full_ladders = st.builds(
    lambda full, floor_share, step_s, fixed_s, cache, fraction, sizes: QualityLadder(
        full_steps=full, min_steps=max(1, round(floor_share * full)), step_s=step_s,
        fixed_s=fixed_s, cache="first_block" if cache else None, cache_fraction=fraction,
        full_size=(64, 64), sizes=tuple((64 - 8 * k, 64 - 8 * k) for k in range(1, sizes + 1))),
    st.integers(1, 60), st.floats(0.0, 1.0), st.floats(1e-3, 10.0), st.floats(0.0, 20.0),
    st.booleans(), st.floats(0.05, 1.0), st.integers(0, 4))


@given(full_ladders, deadlines, loads)
def test_the_level_chosen_is_never_below_the_floor_nor_outside_what_the_job_allows(
        ladder: QualityLadder, deadline_s: float, load: float) -> None:
    # given any job allowing fewer steps, possibly a cache and smaller sizes
    # when admission chooses its level
    chosen = choose_level(ladder, deadline_s, load, POLICY)
    if chosen is None:
        return
    # then it keeps at least its floor of steps, uses only the cache and sizes it allows, is
    # below full quality and costs no more than it
    assert ladder.min_steps <= chosen.steps <= ladder.full_steps
    assert chosen.cache in (None, ladder.cache)
    assert chosen.size is None or chosen.size in ladder.sizes
    assert chosen.level != Level(ladder.full_steps)
    assert ladder.level_work_s(chosen.level) <= ladder.work_s(ladder.full_steps) * (1 + 1e-9)
    # and a level predicted on time is the one of most work that is
    factor = stretch(load)
    if chosen.meets:
        better = [lv for lv in ladder.levels()
                  if ladder.level_work_s(lv) > ladder.level_work_s(chosen.level) * (1 + 1e-9)]
        assert all(factor * ladder.level_work_s(lv) > deadline_s for lv in better)


@given(st.integers(1, 60), st.floats(1e-3, 10.0), st.floats(0.0, 20.0), deadlines, loads)
def test_a_job_without_a_floor_is_never_degraded(
        steps: int, step_s: float, fixed_s: float, deadline_s: float, load: float) -> None:
    # given a job that gave no floor: its ladder allows only what it asked (no fewer steps, no
    # cache, no smaller size)
    ladder = QualityLadder(full_steps=steps, min_steps=steps, step_s=step_s, fixed_s=fixed_s,
                           full_size=(64, 64))
    # then at any load and deadline it runs as asked
    assert ladder.levels() == []
    assert choose_level(ladder, deadline_s, load, POLICY) is None
