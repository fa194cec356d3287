"""Serving the API: the uvicorn command ``stepline up`` runs, and an in-process server on a
background thread (for embedding the API in another program, and for tests)."""

from __future__ import annotations

import sys
import threading
import time

import uvicorn

from app.api.main import create_app
from tasks.settings import Settings


def api_command(settings: Settings) -> list[str]:
    """The API as its own process: uvicorn over the app factory."""
    return [
        sys.executable, "-m", "uvicorn", "--factory", "app.api.main:create_app",
        "--host", settings.service.api_host, "--port", str(settings.service.api_port),
        "--log-level", "warning", "--no-access-log", "--timeout-graceful-shutdown", "5",
    ]


class ThreadedServer:
    """uvicorn serving ``create_app(settings)`` on a daemon thread; a context manager."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int = 0) -> None:

        config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="api")

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout_s: float = 10.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
