"""JSON round trips of the persisted policy state and cost model; the cost model's learning."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import AdmissionState, CostModel, PolicyConfig, PolicyState
from scheduler.errors import StateDecodeError

pytestmark = pytest.mark.timeout(30)

_names = st.text(min_size=1, max_size=8)
_times = st.one_of(st.none(), st.floats(-1e6, 1e6))


@settings(max_examples=100, deadline=None)
@given(origin=st.one_of(st.none(), _names), since=_times, until=_times,
       admission=st.sampled_from(tuple(AdmissionState)), workers=st.lists(_names, max_size=4))
def test_policy_state_survives_a_json_round_trip(origin, since, until, admission,  # type: ignore[no-untyped-def]
                                                  workers) -> None:
    state = PolicyState(origin, since, admission, until, tuple(workers))
    assert PolicyState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_policy_state_from_foreign_json_says_what_to_do() -> None:
    with pytest.raises(StateDecodeError, match="delete the stored state"):
        PolicyState.from_json({"origin_id": 3})


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.tuples(st.sampled_from(("image-256/a", "text", "x")),
                                  st.sampled_from(("cpu", "cuda")),
                                  st.floats(0.1, 100), st.floats(0, 10)), max_size=12))
def test_cost_model_survives_a_json_round_trip(samples) -> None:  # type: ignore[no-untyped-def]
    model = PolicyConfig().new_cost_model()
    for key, device, units, elapsed in samples:
        model = model.observe(key, device, units, elapsed)
    assert CostModel.from_json(json.loads(json.dumps(model.to_json()))) == model


def test_cost_prior_comes_from_the_longest_matching_prefix() -> None:
    model = CostModel(priors_s_per_unit={"image": 0.1, "image-1024": 0.23},
                      default_s_per_unit=0.05)
    assert model.seconds_per_unit("image-1024/flux") == 0.23
    assert model.seconds_per_unit("image-512") == 0.1
    assert model.seconds_per_unit("video") == 0.05


def test_first_measurements_move_the_estimate_more_than_later_ones() -> None:
    # given a prior of 1 s/unit worth one sample
    model = CostModel(default_s_per_unit=1.0, ewma_alpha=0.1, prior_samples=1)
    # when 2 s/unit is measured once, the estimate moves halfway
    once = model.observe("k", "cpu", units=1.0, elapsed_s=2.0)
    assert once.seconds_per_unit("k", "cpu") == pytest.approx(1.5)
    # and after many samples each new one weighs only alpha
    many = once
    for _ in range(50):
        many = many.observe("k", "cpu", 1.0, 2.0)
    before = many.seconds_per_unit("k", "cpu")
    after = many.observe("k", "cpu", 1.0, 12.0).seconds_per_unit("k", "cpu")
    assert after - before == pytest.approx(0.1 * (12.0 - before))


def test_a_chunk_of_no_units_teaches_the_cost_model_nothing() -> None:
    model = CostModel()
    assert model.observe("k", "cpu", 0.0, 1.0) is model


def test_step_estimate_scales_with_units_and_uses_the_device() -> None:
    model = CostModel(default_s_per_unit=0.1).observe("k", "cuda", 1.0, 0.02)
    assert model.estimate_step_s("k", "cuda", units=10) < model.estimate_step_s("k", "cpu", 10)
