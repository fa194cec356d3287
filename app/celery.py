"""The Celery app: ``celery -A app worker -Q realtime,interactive,batch,standby -P solo``.

Queues per SLO class taken in strict order, prefetch 1, JSON only, task events on for Flower,
a visibility timeout sized for step-long tasks. Stepline's job store is the source of truth, so
there is no result backend.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from tasks.events import FLUSH_KEY, consumer_path
from tasks.routing import ALL_QUEUES, CHUNK_TASK, CONTROL, INTERACTIVE, TICK_TASK
from tasks.runtime import (
    KEEPALIVE_OPTIONS,
    broker_url,
    current_settings,
    is_sentinel_url,
    kombu_url,
    use_celery,
)
from tasks.settings import Settings
from tasks.transport import install as install_transport

__all__ = ["CHUNK_TASK", "TICK_TASK", "app", "celery_config", "create_celery_app"]


def broker_connection_options(broker_url: str, settings: Settings) -> dict[str, Any]:
    """TCP keepalives on a networked broker (a hung or unreachable master is noticed), and
    with Sentinel the master's name, the sentinels asked with the same timeouts."""
    if broker_url.startswith("redis+socket://"):
        return {}
    options: dict[str, Any] = {"socket_connect_timeout": 5, "socket_keepalive": True,
                               "socket_keepalive_options": KEEPALIVE_OPTIONS,
                               "health_check_interval": 30}
    if is_sentinel_url(broker_url):
        options["master_name"] = settings.broker.sentinel_master
        options["sentinel_kwargs"] = {"socket_timeout": 5, "socket_connect_timeout": 5}
    return options


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from Stepline's; one place, so workers and clients agree."""
    broker = kombu_url(broker_url(settings))
    interval_s = settings.scheduler.origin_detection_interval
    return {
        "broker_url": broker,
        "broker_transport_options": {
            "queue_order_strategy": "priority",
            "visibility_timeout": settings.broker.visibility_timeout,
            "unacked_restore_interval": settings.broker.unacked_restore_interval,
            "unacked_restore_throttle": 1,
            "socket_timeout": 30,
            **broker_connection_options(broker, settings),
        },
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Each queue on its own direct exchange: a message routed to one queue reaches only it.
        "task_queues": [Queue(name, Exchange(name, type="direct"), routing_key=name)
                        for name in ALL_QUEUES],
        "task_default_queue": INTERACTIVE,
        "task_routes": {TICK_TASK: {"queue": CONTROL}},
        "task_create_missing_queues": False,
        "worker_prefetch_multiplier": 1,
        "task_acks_late": False,  # only the idempotent chunk task acks late
        "task_acks_on_failure_or_timeout": False,
        "worker_send_task_events": settings.broker.task_events,
        "worker_consumer": consumer_path(),
        FLUSH_KEY: settings.broker.task_events_flush,
        "task_send_sent_event": settings.broker.task_sent_events,
        "worker_hijack_root_logger": False,
        "worker_proc_alive_timeout": 120,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "beat_schedule": {
            "scheduler-tick": {
                "task": TICK_TASK,
                "schedule": interval_s,
                "options": {"queue": CONTROL, "expires": max(2 * interval_s, 0.05)},
            }
        },
        "beat_max_loop_interval": max(interval_s / 2, 0.01),
        "timezone": "UTC",
    }


def create_celery_app(settings: Settings | None = None) -> Celery:
    """The Celery app for ``settings``, made the one the runtime publishes with."""
    settings = settings or current_settings()
    install_transport()
    celery_app = Celery("stepline", include=["tasks.chunks", "tasks.batches", "tasks.tick",
                                             "tasks.signals"])
    celery_app.conf.update(celery_config(settings))
    use_celery(celery_app)
    return celery_app


def configure(settings: Settings) -> Celery:
    """Point this process's app at the broker of ``settings``: a command that chooses its run
    directory (bench, demo, drills, the API factory) does so after this module built the app
    from the settings of the moment it was first imported."""
    config = celery_config(settings)
    if app.conf.broker_url != config["broker_url"]:
        app.conf.update(config)
        # the next publish builds connections and producers for the new broker (those of the
        # previous one are dropped, not closed: a thread may still be finishing a publish)
        app._pool = None
        app.amqp._producer_pool = None
    return app


app = create_celery_app()
