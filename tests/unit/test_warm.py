"""Warm start's jobs: one tiny, valid job per configured recipe, with the recipe's defaults."""

from __future__ import annotations

import pytest

from workers.moe.params import validate_params as validate_text
from workers.registry import default_registry
from workers.warm import WARM_STEPS, warm_jobs

pytestmark = pytest.mark.timeout(60)


def test_every_configured_recipe_gets_one_valid_tiny_warm_up_job() -> None:
    # when the warm-up jobs are listed
    jobs = {job.recipe: job for job in warm_jobs()}
    # then there is one per recipe, of its kind, valid as a submitted job would be
    registry = default_registry()
    assert sorted(jobs) == sorted(registry.names())
    for name, job in jobs.items():
        assert job.kind == registry.get(name).kind
        if job.kind == "text":
            assert validate_text(job.params).max_new_tokens == WARM_STEPS
        else:
            assert job.params["num_inference_steps"] == WARM_STEPS
    assert jobs["dit-tiny"].params["class_label"] == 0
    assert jobs["pixart-tiny"].params["prompt"]
