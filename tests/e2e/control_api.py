"""A minimal API served beside the real one in event-loop tests: the same uvicorn, a sync route
that pings the same Redis, and nothing else, so its latency is the machine's noise floor."""

from __future__ import annotations

import os

import redis
from fastapi import FastAPI


def create_app() -> FastAPI:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    api = FastAPI()

    @api.get("/healthz")
    def healthz() -> dict[str, str]:
        client.ping()
        return {"status": "ok"}

    return api
