"""One typed settings tree: configs/default.yaml, then an optional ``--config`` file, then
``STEPLINE_*`` environment variables (``__`` nests: ``STEPLINE_SCHEDULER__POLICY=fifo``).

An invalid value fails at start with the environment variable that set it (else its key), the
value and the bound, one line per value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as EnvSourceError

from tasks.errors import SettingsError
from tasks.redact import mask_url
from tasks.settings.affinity import AffinitySettings
from tasks.settings.api import ApiSettings
from tasks.settings.artifacts import ArtifactSettings
from tasks.settings.autoscale import AutoscaleSettings
from tasks.settings.diffusion import DiffusionSettings
from tasks.settings.durations import Seconds
from tasks.settings.environment import (
    ENV_PREFIX,
    NESTING,
    EnvValue,
    describe_error,
    env_values,
    unreadable_values,
)
from tasks.settings.moe import MoeSettings
from tasks.settings.scheduler import SchedulerSettings
from tasks.settings.workers import ResidencySettings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "default.yaml"


BROKER_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
"""The URL forms ``broker.url`` takes (those of ``REDIS_URL``)."""


class BrokerSettings(BaseModel):
    """Celery and Redis transport knobs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = None
    """Celery's broker, when it lives apart from the job store (``REDIS_URL``): ``redis://``,
    ``rediss://``, ``unix://`` or Sentinel's ``sentinel://...;sentinel://...`` (its master
    named ``sentinel_master``). null: the store's Redis carries the queues too. Apart, a hop
    is two round trips instead of one (``direct_publish`` is off in effect: the commit cannot
    push a message onto another server in its own script) and the queue depths are read from
    the broker; a chunk committed but never published is requeued by the tick after
    ``chunk_lease``."""
    visibility_timeout: Seconds = Field(default=120.0, ge=1, le=86400)
    """An unacknowledged chunk is redelivered after this long; sized for the longest step.
    Seconds, in [1, 86400]."""
    unacked_restore_interval: Seconds = Field(default=5.0, ge=0.1, le=3600)
    """How often a worker sweeps for chunks whose worker died. Seconds, in [0.1, 3600]."""
    chunk_lease: Seconds = Field(default=10.0, ge=0.5, le=3600)
    """A running chunk's lease: refreshed three times within it, and a job whose lease lapses
    is requeued. Seconds, in [0.5, 3600]."""
    stuck_factor: float = Field(default=10.0, ge=2, le=1000)
    """A chunk whose worker still heartbeats but which has run this many times its expected
    step time is stuck: it is requeued from its checkpoint under a new epoch. A factor, in
    [2, 1000]."""
    stuck_min_s: Seconds = Field(default=5.0, ge=0.1, le=86400)
    """Floor of the stuck threshold, so short steps with noisy timings are never requeued.
    Seconds, in [0.1, 86400]."""
    task_events: bool = True
    """Celery's task events from the workers (received, started, succeeded, failed, …), what
    Flower's task list and ``celery events`` are made of; each costs a hop worker time unless
    coalesced (``task_events_flush``). Off, Flower still shows the workers (heartbeats) and
    ``celery inspect`` still answers, but lists no tasks."""
    task_events_flush: Seconds = Field(default=0.2, ge=0, le=10)
    """A worker sends its buffered task events at most this often (and when 24 are waiting),
    so hops share publishes (``tasks/events.py``); Flower shows them up to this much later.
    0: Celery's own timing, one publish per task. Seconds, in [0, 10]."""
    task_sent_events: bool = False
    """Celery's ``task-sent`` event for every chunk published: a publish timestamp in Flower,
    at a cost to each hop (Flower's task list comes from the workers' events without it)."""
    direct_publish: bool = True
    """Stepline puts chunk and batch messages on their queues itself: the message Celery would
    send (protocol 2 in kombu's Redis envelope), pushed by the commit script when a job hops
    (commit, publish and bookkeeping in one round trip) or, for the tick's releases and a
    batch's hops, in one MULTI with the records' bookkeeping. Off: Celery's ``send_task``,
    then the bookkeeping, two round trips per hop. ``task_sent_events`` needs Celery's
    publish and turns it off."""
    event_retention: Seconds | None = Field(default=7 * 86400.0, gt=0, le=366 * 86400.0)
    """How long a job's event history (every transition, preemption and commit) is kept after
    the job ends; null keeps it for ever. It is never trimmed while the job lives. Seconds, in
    (0, 31622400] (366 days: a retention given in milliseconds is refused)."""
    sentinel_master: str = Field(default="stepline", min_length=1, max_length=200)
    """With a Sentinel ``REDIS_URL`` (``sentinel://h1:26379;sentinel://h2:26379``): the name
    the sentinels monitor the master under (kombu's ``master_name``); 1 to 200 characters."""
    commit_replicas: int = Field(default=0, ge=0, le=16)
    """After each commit, wait until this many replicas hold it (Redis ``WAIT``, in the same
    round trip) before the worker acknowledges the chunk, so a failover promoting one of them
    cannot lose it; a new job the API creates likewise, else it answers 503 (retry with the
    same idempotency key) instead of accepting a job a failover could drop. 0 (one server): no
    wait. With Sentinel, the number of replicas: with more replicas than this, the one that
    acknowledged may be re-pointed at another, promoted one and drop the write. Replicas, in
    [0, 16]."""
    commit_replica_timeout: Seconds = Field(default=0.5, gt=0, le=60)
    """The longest a commit waits for its replicas; past it the worker goes on (logged): a
    commit a failover then loses is replayed from the previous checkpoint (the fences).
    Seconds, in (0, 60]."""
    redis_appendfsync: Literal["always", "everysec", "no"] = "everysec"
    """fsync policy of the embedded Redis's append-only file: ``everysec`` may lose about the
    last second of writes to a machine crash (not to a killed redis-server); ``always`` loses
    no acknowledged write, at a throughput cost."""

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(BROKER_SCHEMES):
            raise ValueError(f"expected a Redis URL ({', '.join(BROKER_SCHEMES)}) or null, "
                             f"not {mask_url(url)!r}")
        return url


class ServiceSettings(BaseModel):
    """Addresses of the API and Flower; the worker autoscaler of ``stepline up``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    api_host: str = "127.0.0.1"
    """Interface the REST shim listens on."""
    api_port: int = Field(default=8080, ge=1, le=65535)
    """Port of the REST shim (the reference design's), in [1, 65535]."""
    flower_port: int = Field(default=5555, ge=1, le=65535)
    """Port of Flower, in [1, 65535]."""
    autoscale: AutoscaleSettings = Field(default_factory=AutoscaleSettings)
    """Adding and draining local workers (``stepline up --workers MIN:MAX``)."""


class Settings(BaseSettings):
    """Every tunable of Stepline."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTING,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")
    """Redis to use; unset → the embedded server under the run directory."""
    run_dir: Path = Path(".stepline")
    """Where the embedded Redis, logs, the API key and artifacts live."""
    artifact_dir: Path | None = None
    """Where finished artifacts go; unset → ``<run_dir>/artifacts`` (``artifacts.url`` outranks
    it, and may name a shared store)."""
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    """The artifact store: a local directory, or an fsspec URL (``s3://``) all hosts share."""
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?|simulated)$")
    """Device the worker runs models on: ``cpu``, ``cuda``, ``cuda:N`` or ``simulated``."""
    torch_threads: int = Field(default=1, ge=0, le=256)
    """Intra-op threads per worker process (0: torch's default); one worker per device.
    Threads, in [0, 256]."""
    warm_start: bool = True
    """A worker runs one tiny job of every recipe before it takes work (torch, the models and
    their kernels built), so the first real job is as fast as the next; /readyz says when
    every worker is warm. false: build each model on its first job."""
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    """The SLO scheduler."""
    moe: MoeSettings = Field(default_factory=MoeSettings)
    """MoE serving."""
    diffusion: DiffusionSettings = Field(default_factory=DiffusionSettings)
    """Diffusion jobs."""
    residency: ResidencySettings = Field(default_factory=ResidencySettings)
    """The built models a worker keeps, under a memory budget."""
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    """Celery transport."""
    affinity: AffinitySettings = Field(default_factory=AffinitySettings)
    """Same-worker continuation of chunks (expert and checkpoint affinity)."""
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    """API and Flower addresses."""
    api: ApiSettings = Field(default_factory=ApiSettings)
    """The REST shim: API keys, tenants, quotas."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment outranks the files, which arrive through init kwargs.
        return (env_settings, init_settings)

    @property
    def artifacts_path(self) -> Path:
        return self.artifact_dir or self.run_dir / "artifacts"

    @property
    def artifacts_url(self) -> str:
        """The artifact store's fsspec URL (a plain path for the local default)."""
        return self.artifacts.url or str(self.artifacts_path)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(loaded, dict):
        raise SettingsError(f"config file {path} must hold a mapping at the top level")
    return loaded


def _describe(error: ValidationError, values: list[EnvValue]) -> str:
    """One line per bad value, naming the variable that set it (or its key) and the bound."""
    return "\n".join(describe_error(item, values) for item in error.errors())


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings tree; raises :class:`SettingsError` with one line per bad value,
    naming the environment variable that set it (else its key), the value and the bound."""
    data = _read_yaml(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else {}
    extra = config_file or (Path(p) if (p := os.environ.get("STEPLINE_CONFIG")) else None)
    if extra is not None:
        data = _deep_merge(data, _read_yaml(extra))
    data = _deep_merge(data, overrides)
    values = env_values(os.environ)
    unreadable = unreadable_values(Settings, values)
    if unreadable:
        raise SettingsError("\n".join(unreadable))
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, values)) from exc
    except EnvSourceError as exc:  # a shape unreadable_values does not foresee
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise SettingsError(f"invalid environment: {exc}{cause}") from exc


__all__ = [
    "AffinitySettings", "ApiSettings", "AutoscaleSettings", "DiffusionSettings", "MoeSettings",
    "ResidencySettings", "SchedulerSettings", "Settings", "load_settings",
]
