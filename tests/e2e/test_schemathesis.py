"""Generated requests against the published OpenAPI: whatever arrives, never a 5xx.

The app runs in-process (ASGI) over the session's real Redis, with a key that no rate limit or
quota stops. POST /v1/inference waits on a worker by design (504 when none finishes the job), so
only its invalid bodies are sent here; test_api covers its valid path.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error

from app.api.context import ApiContext
from app.api.main import create_app
from app.api.observe import registry_for
from app.schemas import InferenceRequest
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


FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@SCHEMA.exclude(path="/v1/inference").parametrize()
@FAST
def test_no_request_to_any_route_gets_a_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=HEADERS, checks=[not_a_server_error])


@SCHEMA.include(path="/v1/inference").parametrize()
@FAST
def test_no_invalid_inference_request_gets_a_server_error(case: schemathesis.Case) -> None:
    try:
        InferenceRequest.model_validate(case.body)
    except ValidationError:
        case.call_and_validate(headers=HEADERS, checks=[not_a_server_error])
    # A valid body waits for a worker that is not there: test_api covers its 200 and 504.
