"""The Celery application: Redis broker, queues `coordinator`, `clone`, `cpu` and `gpu`.

Start workers with `grove worker --queues cpu` (or `celery -A backend.worker.celery_app worker -Q cpu`).
The `clone` queue takes clones of studies' repositories from URLs (`clone.repository`): a worker of
its own beside the database, so a remote that hangs holds no coordinator or experiment slot.
"""

from __future__ import annotations

from celery import Celery
from kombu.entity import Queue

from backend.core.config import Settings, get_settings

QUEUES = ("coordinator", "clone", "cpu", "gpu", "sealed", "gpu-sealed")
JOB_QUEUES = ("cpu", "gpu", "sealed", "gpu-sealed")  # where job tasks wait for a worker
CLONE_TASK = "clone.repository"


def make_app(settings: Settings) -> Celery:
    """Return a configured Celery app."""
    app = Celery("grove", broker=settings.redis_url, include=["backend.worker.tasks"])
    app.conf.update(
        task_queues=tuple(Queue(name) for name in QUEUES),  # type: ignore[no-untyped-call]  # kombu leaves Queue unannotated
        task_default_queue="cpu",
        task_routes={
            # Sealed jobs (the baseline, held-out runs, gates) on queues of their own: only workers
            # beside the database, or remote ones with a `sealed` token, ever get sealed bytes.
            "cpu.sealed": {"queue": "sealed"},
            "gpu.sealed": {"queue": "gpu-sealed"},
            "coordinator.*": {"queue": "coordinator"},
            "clone.*": {"queue": "clone"},
            "cpu.*": {"queue": "cpu"},
            "gpu.*": {"queue": "gpu"},
        },
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        beat_schedule={
            "reconcile": {"task": "coordinator.reconcile", "schedule": settings.reconcile_seconds}
        },
        worker_soft_shutdown_timeout=10.0,
    )
    return app


app = make_app(get_settings())
