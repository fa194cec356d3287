"""Generated requests against the published OpenAPI: whatever arrives, never a 5xx.

The app runs in-process (ASGI) over the session's real Redis, with a key that no rate limit or
quota stops. POST /v1/inference and the OpenAI-compatible generation routes wait on a worker by
design, so only their invalid bodies are sent here; test_api and test_openai cover their valid
paths. GET /readyz answers 503 by design while no warm worker is there (as here): it is held to
its documented answers instead.
"""

from __future__ import annotations

import re

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import ValidationError
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from app.api.context import ApiContext
from app.api.main import create_app
from app.api.observe import registry_for
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageRequest,
    InferenceRequest,
)
from tasks.settings import Settings, load_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "fuzz-key-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def fuzz_settings(redis_url: str) -> Settings:
    keys = [{"key": KEY, "tenant": "fuzz", "rate_limit_per_s": 100_000, "burst": 100_000,
             "max_queued": 1_000_000}]
    return load_settings(api={"keys": keys}, redis_url=redis_url)


# The schema is read at import; the Redis behind the app is the session's, swapped in per test.
APP = create_app(fuzz_settings("unix:///nonexistent/redis.sock"))
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(autouse=True)
def _real_redis(stack_env: dict[str, str]) -> None:
    APP.state.ctx = ApiContext.from_settings(fuzz_settings(stack_env["REDIS_URL"]))
    APP.state.registry = registry_for(APP.state.ctx)


WAITING = {"/v1/inference": InferenceRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/completions": CompletionRequest, "/v1/images/generations": ImageRequest}
"""Routes that answer once a worker finished the job, and the body each one validates."""
WAITING_PATHS = "^(" + "|".join(re.escape(path) for path in WAITING) + ")$"
READINESS = "/readyz"
"""503 while no warm chunk worker is alive: a readiness probe's documented answer."""

FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@SCHEMA.exclude(path_regex=WAITING_PATHS).exclude(path=READINESS).parametrize()
@FAST
def test_no_request_to_any_route_gets_a_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=HEADERS, checks=[not_a_server_error])


@SCHEMA.include(path=READINESS).parametrize()
@FAST
def test_the_readiness_probe_answers_only_what_it_documents(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=HEADERS,
                           checks=[status_code_conformance, response_schema_conformance])


@SCHEMA.include(path_regex=WAITING_PATHS).parametrize()
@FAST
def test_no_invalid_request_to_a_waiting_route_gets_a_server_error(
    case: schemathesis.Case,
) -> None:
    try:
        WAITING[case.path].model_validate(case.body)
    except ValidationError:
        case.call_and_validate(headers=HEADERS, checks=[not_a_server_error])
    # A valid body waits for a worker that is not there: test_api and test_openai cover it.
