"""The Python client of the REST API: ``Client().submit(...)``, ``.wait(...)``, ``.result(...)``.

The API key comes from the ``api_key`` argument, else ``STEPLINE_API_KEY``, else the development
key ``stepline up`` wrote to ``<run_dir>/api-key``. The address comes from ``base_url``, else
``STEPLINE_API_URL``, else the address ``stepline up`` wrote to ``<run_dir>/api-url``, else
``service.api_host``/``service.api_port`` of the settings.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from pydantic import BaseModel

from app.run_files import API_KEY_FILE, API_URL_FILE, read_run_file
from app.schemas import (
    MAX_BATCH,
    AdapterList,
    BatchEntry,
    BatchSubmit,
    BatchSubmitted,
    InferenceResponse,
    JobDetail,
    JobPage,
    JobSpec,
    StatsView,
)
from scheduler.lifecycle import JobState, SloClass
from tasks.errors import InvalidJob, JobNotFound, SteplineError

if TYPE_CHECKING:  # the settings tree is imported only when the address must come from it
    from tasks.settings import Settings

M = TypeVar("M", bound=BaseModel)


class ApiError(SteplineError):
    """Raised when the API answers with an error; ``status`` and ``detail`` say which."""

    def __init__(self, status: int, detail: str, retry_after_s: float | None = None,
                 job_id: str | None = None) -> None:
        super().__init__(f"{detail} (HTTP {status})" if status else detail)
        self.status, self.detail = status, detail
        self.retry_after_s, self.job_id = retry_after_s, job_id


class ApiUnreachable(ApiError):
    """Raised when nothing answers at the API's address (is ``stepline up`` running?)."""


class Unauthorized(ApiError):
    """Raised when the API key is missing or unknown (401)."""


class JobMissing(ApiError, JobNotFound):
    """Raised when the job does not exist or belongs to another tenant (404)."""


class Rejected(ApiError, InvalidJob):
    """Raised when the API rejects a request as invalid (422)."""


class NotReady(ApiError):
    """Raised when a job's result is asked for before it is DONE (409)."""


class RateLimited(ApiError):
    """Raised on 429 (rate limit or queue quota); ``retry_after_s`` says when to retry."""


class WaitTimeout(SteplineError):
    """Raised when :meth:`Client.wait` gives up before the job ended."""


_BY_STATUS: dict[int, type[ApiError]] = {
    401: Unauthorized, 404: JobMissing, 409: NotReady, 422: Rejected, 429: RateLimited,
}


def find_api_key(run_dir: Path | None = None) -> str | None:
    """``STEPLINE_API_KEY``, else the development key under the run directory, else None."""
    if key := os.environ.get("STEPLINE_API_KEY"):
        return key
    return read_run_file(_run_dir(run_dir), API_KEY_FILE)


def _run_dir(run_dir: Path | None) -> Path:
    return run_dir or Path(os.environ.get("STEPLINE_RUN_DIR", ".stepline"))


def default_base_url(settings: Settings | None = None, run_dir: Path | None = None) -> str:
    """``STEPLINE_API_URL``, else the running stack's address in the run directory (given
    settings: theirs), else the configured ``service.api_host``/``api_port``."""
    if url := os.environ.get("STEPLINE_API_URL"):
        return url.rstrip("/")
    if settings is None:
        if url := read_run_file(_run_dir(run_dir), API_URL_FILE):
            return url.rstrip("/")
        from tasks.runtime import current_settings  # deferred: the settings tree

        settings = current_settings()
    return f"http://{settings.service.api_host}:{settings.service.api_port}"


class Client:
    """A synchronous client of one Stepline API (a context manager; close() when done)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        run_dir: Path | None = None,
        settings: Settings | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if run_dir is None and settings is not None:
            run_dir = Path(settings.run_dir)
        self.base_url = (base_url or default_base_url(settings, run_dir)).rstrip("/")
        key = api_key or find_api_key(run_dir)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # TLS only for an https address: building a verifying context loads the CA bundle,
        # a tenth of a second a command line pays for nothing on plain http
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s,
                                 transport=transport,
                                 verify=self.base_url.lower().startswith("https:"))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # transport --------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiUnreachable(
                0, f"cannot reach the Stepline API at {self.base_url} ({exc}); "
                "start it with `stepline up`, or set STEPLINE_API_URL") from exc
        if response.is_success:
            return response
        raise _error_of(response)

    def _model(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        return model.model_validate(self._request(method, path, **kwargs).json())

    # jobs -------------------------------------------------------------------------------------
    def submit(
        self,
        spec: JobSpec | None = None,
        *,
        kind: str = "simulated",
        slo: SloClass | str = SloClass.INTERACTIVE,
        params: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
        adapters: list[tuple[str, float]] | None = None,
        image: bytes | None = None,
        mask: bytes | None = None,
        control_image: bytes | None = None,
    ) -> JobDetail:
        """Submit ``spec`` (or one built from the keywords); returns the job as stored.
        ``adapters``: (name, scale) LoRA adapters of an image or video job, in order;
        ``image``, ``mask``: its input image and inpainting mask (PNG, JPEG or WebP bytes,
        sent as base64 and stored by the API under their digest); ``image`` is also the first
        frame of an image-to-video model's video job (which needs one); ``control_image``: a
        ControlNet job's control image (``params.controlnet`` names the ControlNet)."""
        if spec is None:
            params = dict(params or {})
            for role, data in (("image", image), ("mask", mask),
                               ("control_image", control_image)):
                if data is not None:
                    params[role] = base64.b64encode(data).decode("ascii")
            if adapters:
                params["adapters"] = [{"name": name, "scale": scale} for name, scale in adapters]
            spec = JobSpec.model_validate({
                "kind": kind, "slo": slo, "params": params, "deadline_s": deadline_s,
                "idempotency_key": idempotency_key,
            })
        body = spec.model_dump(mode="json", exclude_none=True)
        return self._model(JobDetail, "POST", "/v1/jobs", json=body)

    def upload_input(self, data: bytes) -> str:
        """Store an input image or mask (``POST /v1/inputs``); its digest, for ``params``."""
        response = self._request("POST", "/v1/inputs", files={"file": ("input", data)})
        return str(response.json()["digest"])

    def submit_many(self, specs: list[JobSpec], batch_size: int = MAX_BATCH) -> list[BatchEntry]:
        """Submit ``specs`` through POST /v1/jobs/batch, ``batch_size`` per request (each
        request spends one rate-limit token per job: at most the key's burst); one entry per
        job, in order: its id, or why admission shed it. A bad job raises before any job of its
        request is stored."""
        if not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size {batch_size}: use 1 to {MAX_BATCH}")
        entries: list[BatchEntry] = []
        for start in range(0, len(specs), batch_size):
            body = BatchSubmit(jobs=specs[start:start + batch_size])
            answer = self._model(BatchSubmitted, "POST", "/v1/jobs/batch",
                                 json=body.model_dump(mode="json", exclude_none=True))
            entries.extend(answer.jobs)
        return entries

    def get(self, job_id: str) -> JobDetail:
        return self._model(JobDetail, "GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> JobDetail:
        """Cancel; the returned view shows CANCELLED, or RUNNING until the chunk boundary."""
        return self._model(JobDetail, "DELETE", f"/v1/jobs/{job_id}")

    def result(self, job_id: str) -> bytes:
        """The artifact's bytes (PNG, MP4, JSON ...); :class:`NotReady` before DONE."""
        return self._request("GET", f"/v1/jobs/{job_id}/result").content

    def list(
        self,
        *,
        state: JobState | str | None = None,
        slo: SloClass | str | None = None,
        limit: int = 50,
        offset: int = 0,
        cursor: str | None = None,
    ) -> JobPage:
        """One page of the caller's jobs, newest first (pass ``page.next_cursor`` on)."""
        query: dict[str, Any] = {"limit": limit, "offset": offset}
        for name, value in (("state", state), ("class", slo), ("cursor", cursor)):
            if value is not None:
                query[name] = getattr(value, "value", value)
        return self._model(JobPage, "GET", "/v1/jobs", params=query)

    def wait(
        self,
        job_id: str,
        *,
        timeout_s: float | None = None,
        poll_s: float = 0.1,
        progress: bool = False,
    ) -> JobDetail:
        """Poll until the job ends; with ``progress``, draw a rich progress bar meanwhile."""
        if not progress:
            return self._wait(job_id, timeout_s, poll_s, lambda view: None)
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task(job_id, total=None)
            return self._wait(job_id, timeout_s, poll_s, lambda view: bar.update(
                task, total=view.total, completed=view.progress,
                description=f"{job_id} {view.slo.value} {view.state.value}"
                + (" ★ origin" if view.origin else "")))

    def _wait(self, job_id: str, timeout_s: float | None, poll_s: float,
              show: Any) -> JobDetail:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            view = self.get(job_id)
            show(view)
            if view.state.is_terminal:
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} still {view.state.value} after {timeout_s}s")
            time.sleep(poll_s)

    # service ----------------------------------------------------------------------------------
    def infer(self, inputs: str, *, params: dict[str, Any] | None = None,
              slo: str | None = None) -> InferenceResponse:
        """Text in, text out, within the class deadline (504 → :class:`ApiError`)."""
        body: dict[str, Any] = {"inputs": inputs, "parameters": params or {}}
        if slo is not None:
            body["slo"] = slo
        return self._model(InferenceResponse, "POST", "/v1/inference", json=body)

    def adapters(self) -> AdapterList:
        """The LoRA adapters jobs may name, each with the model it fits."""
        return self._model(AdapterList, "GET", "/v1/adapters")

    def stats(self) -> StatsView:
        return self._model(StatsView, "GET", "/v1/stats")

    def healthy(self) -> bool:
        """Whether the API answers and its Redis does."""
        try:
            self._request("GET", "/healthz")
        except ApiError:
            return False
        return True


def _error_of(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    detail = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(detail, str):
        detail = response.text[:500] or response.reason_phrase
    retry = response.headers.get("Retry-After")
    kind = _BY_STATUS.get(response.status_code, ApiError)
    return kind(response.status_code, detail, float(retry) if retry else None,
                body.get("job_id") if isinstance(body, dict) else None)
