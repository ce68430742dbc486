"""Celery tasks: coordinator steps, experiments on `cpu`/`gpu`, and the reconciler.

Executor tasks never wait on other tasks: they enqueue `coordinator.advance` once their outcome
is stored (an experiment before it cleans its worktree up, so the coordinator's step overlaps it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import traceback
from collections.abc import Callable

import redis
import sqlalchemy.exc
from celery import Task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import celeryd_after_setup, worker_process_init, worker_process_shutdown, worker_ready
from celery.worker.control import control_command
from sqlmodel import col, select

from agents.policies import optuna_bridge
from agents.policies.registry import PolicyUnavailable
from agents.spec import SpecError
from agents.tree.status import StopRule, StudyStatus
from backend.core import cloning, db, fanout, gitops
from backend.core.config import Settings, get_settings
from backend.core.gitops import GitError
from backend.core.locks import Busy, client, coalesced, lease
from backend.core.models import Job, Study, now
from backend.core.states import JobStatus
from backend.engine import driver, experiment, housekeeping, learning, sandbox, sealed, workspace
from backend.engine.driver import Driver
from backend.engine.jobstore import Superseded, Unreachable
from backend.engine.site import LocalSite, Site
from backend.services import lifecycle
from backend.services.spec_errors import repository_error
from backend.services.studies import clone_study
from backend.worker import remote
from backend.worker.celery_app import CLONE_TASK, JOB_QUEUES, app
from backend.worker.dispatch import CeleryDispatcher, enqueue_advance

log = logging.getLogger(__name__)
_coordinating = False  # this worker consumes the coordinator queue (set before the pool forks)
_only_coordinating = False  # and no other: its processes run no torch but the GP's


@control_command(args=[("name", str)], signature="<study name>")
def grove_forget(state: object, name: str) -> dict[str, str]:
    """Remove a remote worker's copies of a study once the API says it ended (the coordinator broadcasts it)."""
    settings = get_settings()
    if not settings.worker_token:
        return {"ok": "beside the database: Grove's own folders are the coordinator's to clean"}
    try:
        removed = remote.site(settings).forget_ended([name])
    except (remote.RemoteError, Superseded) as exc:
        return {"error": str(exc)[:500]}
    return {"ok": f"removed {len(removed)} folders of {name}"}


@worker_ready.connect
def _forget_on_start(**_: object) -> None:
    """Remove what this remote worker still holds of studies that ended while it was away."""
    settings = get_settings()
    if settings.worker_token:
        try:
            remote.site(settings).forget_ended()
        except (remote.RemoteError, Superseded) as exc:
            log.warning("could not ask the API which studies ended: %s", exc)


def _broadcast_end(study_id: int) -> None:
    """Tell every worker that a study ended, so remote ones drop their copies of it."""
    settings = get_settings()
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        if st is None or st.status not in (StudyStatus.FINISHED, StudyStatus.FAILED):
            return
        name = st.name
    try:
        app.control.broadcast("grove_forget", arguments={"name": name})
    except Exception as exc:  # the broker is away: workers forget at their next start or `grove janitor`
        log.warning("study %s: could not broadcast its end: %s", name, exc)


@celeryd_after_setup.connect
def _after_setup(instance: object, **_: object) -> None:
    global _coordinating, _only_coordinating
    queues = getattr(getattr(instance, "app", app).amqp.queues, "consume_from", None) or {}
    if "coordinator" in queues:
        _coordinating = True
        _only_coordinating = set(queues) == {"coordinator"}
        # Once, before the pool forks: its processes share the modules (nothing runs on a GPU here).
        optuna_bridge.preload()
        driver.compiled()
    if not (queues and set(queues) <= {"coordinator", "clone"}):  # these run no study's code
        # Once, before the pool forks: its processes inherit a success instead of each testing a box
        # on its first job. A failure is not kept: each job tests again, and says how to fix it.
        sandbox.warm(workspace.isolation_of(get_settings()))


@worker_process_init.connect
def _init_process(**_: object) -> None:
    settings = get_settings()
    fanout.enable(settings.redis_url)
    pin_gpu()
    if _only_coordinating:
        optuna_bridge.one_thread()
    if _coordinating:
        optuna_bridge.warm_up()  # in each pool process: a study's first GP step is not slowed
    if not settings.worker_token:
        warm_database(settings)


@worker_process_shutdown.connect
def _end_process(**_: object) -> None:
    """In a pool process that ends: kill the git commands and unboxed runs it started (groups of their own)."""
    gitops.kill_all()
    sandbox.kill_all()


def warm_database(settings: Settings) -> None:
    """Open this pool process's database engine (and the coordinator's checkpointer) before its first task.

    Each process otherwise pays for them (the schema check among them) on the first job it takes,
    which then starts about a tenth of a second late. A failure is only logged: that job tries again.
    """
    try:
        db.get_engine(settings.db_url)
        if _coordinating:
            with driver.checkpointer(settings):
                pass
    except Exception:
        traceback.print_exc()


def pin_gpu() -> None:
    """In a `gpu` worker's pool process, see exactly one device: the process index picks it.

    Runs after the fork and before anything imports torch, so CUDA is first initialised in the child.
    """
    devices = os.environ.get("GROVE_GPU_DEVICES", "")
    if not devices:
        return
    from billiard.process import current_process

    choices = [d for d in devices.split(",") if d]
    index = getattr(current_process(), "index", 0) or 0
    os.environ["CUDA_VISIBLE_DEVICES"] = choices[index % len(choices)]


@app.task(name=CLONE_TASK)
def clone(study_id: int) -> str:
    """Clone a study's repository off the request path: it becomes created (and starts), or failed.

    It runs on the `clone` queue, never in a coordinator slot: a remote that hangs holds a clone
    worker's slot for `GROVE_CLONE_FIRST_BYTE_TIMEOUT` at most, and no study's advance waits for it.
    """
    settings = get_settings()
    source = ""
    try:
        with (
            lease(settings.redis_url, f"grove:clone:{study_id}", 2 * settings.lease_seconds),
            db.session(settings.db_url) as s,
        ):
            st = s.get(Study, study_id)
            if st is None or st.status != StudyStatus.CLONING:
                return "skipped"
            source = st.source
            clone_study(s, settings, st, policy=True)
    except Busy:
        return "busy"
    except Exception as exc:  # any failure ends the study with its reason; none leaves it cloning
        step: StopRule | None = None
        if isinstance(exc, SpecError):
            reason = str(exc)
        elif gitops.is_url(source):
            # Viewers read the reason: what happened in plain words. The full error goes to this log.
            reason, step = cloning.failure(source, exc), StopRule.CLONE
            log.warning("study %s: clone of %s failed: %s", study_id, source, exc)
        else:
            reason = str(repository_error(exc)["message"])
        if not isinstance(exc, SpecError | GitError | FileNotFoundError | cloning.HostRefused):
            traceback.print_exc()
        with db.session(settings.db_url) as s:
            if s.get(Study, study_id) is not None:
                lifecycle.fail(s, study_id, reason, step)
        return "failed"
    enqueue_advance(app, study_id)
    return "created"


@app.task(name="coordinator.advance", bind=True)
def advance(self: Task, study_id: int) -> str:
    """Advance a study's graph under its lock; if another step holds it, that step runs once more."""
    settings = get_settings()
    with db.session(settings.db_url) as s:
        st = s.get(Study, study_id)
        if st is None or not st.repo_path:
            return "not cloned"  # still cloning, or its clone failed: there is no graph to run
    finished = False

    def step() -> bool:
        nonlocal finished
        dispatcher = CeleryDispatcher(settings, app)
        # The coordinator only decides: the sealed evaluations run as jobs on the study's queue.
        try:
            driver = Driver(
                settings, study_id, dispatcher, gatekeeper=sealed.SealedJobs(settings, dispatcher.submit)
            )
        except PolicyUnavailable as exc:  # e.g. the service's GROVE_MODEL was unset after the study was made
            with db.session(settings.db_url) as s:
                lifecycle.fail(s, study_id, f"policy: {exc}")
            finished = True
            return True
        finished = driver.advance().finished
        return finished

    # Advances that find the study busy are coalesced into one more step of the holder.
    ran = coalesced(
        settings.redis_url, f"grove:study:{study_id}", 2 * settings.lease_seconds, step,
        lambda delay: enqueue_advance(app, study_id, countdown=delay),
    )  # fmt: skip
    if not ran:
        return "busy"
    if finished:
        _broadcast_end(study_id)
    return "finished" if finished else "waiting"


def site_of(settings: Settings) -> Site:
    """Return where this worker runs jobs: beside the database, or through the API (`GROVE_WORKER_TOKEN`)."""
    if settings.worker_token:
        return remote.site(settings)
    return LocalSite(settings)


def _job(
    job_id: int, token: str, study_id: int | None, run: Callable[[Site, int, str, Callable[[], None]], str]
) -> str:
    """Run a job under its lease and wake the coordinator once: when `run` says its outcome is stored, else at the end.

    A duplicate delivery finds the lease held.
    """
    settings = get_settings()
    if study_id is None and not settings.worker_token:  # a task sent before tasks carried their study
        with db.session(settings.db_url) as s:
            job = s.get(Job, job_id)
            study_id = job.study_id if job else None
    if study_id is None:
        return "unknown job"
    woken = False

    def wake() -> None:
        nonlocal woken
        if woken or study_id is None:
            return
        try:
            enqueue_advance(app, study_id)
        except Exception:  # the broker is away: the wake at the end (or the reconciler) tries again
            traceback.print_exc()
            return
        woken = True

    try:
        with lease(settings.redis_url, f"grove:job:{job_id}", settings.lease_seconds):
            site = site_of(settings)
            housekeeping.make_room(
                settings, site.forget_ended if isinstance(site, remote.RemoteSite) else None
            )
            status = run(site, job_id, token, wake)
    except Busy:
        return "running elsewhere"
    if not woken and study_id is not None:
        enqueue_advance(app, study_id)
    return status


def _sealed(site: Site, job_id: int, token: str, stored: Callable[[], None]) -> str:
    return sealed.run(site, job_id, token)


# Faults of the service around a job rather than of the job: it stays as it was, to be sent again.
PASSING: tuple[type[Exception], ...] = (
    Unreachable, sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
)  # fmt: skip


def _experiment(site: Site, job_id: int, token: str, stored: Callable[[], None]) -> str:
    try:
        return str(experiment.run_experiment(site, job_id, token, stored))
    except Superseded:
        return "superseded"
    except SoftTimeLimitExceeded:
        site.crash(job_id, token, "the experiment ran past its time limit")
        return "failed"
    except PASSING:
        raise  # the API, the database or Redis is away: the job is sent again once its lease has lapsed
    except Exception as exc:  # what nothing foresaw fails the job with its reason: none stays running
        traceback.print_exc()
        site.crash(job_id, token, f"{type(exc).__name__}: {exc}"[:2000])
        return "failed"


@app.task(name="cpu.experiment")
def experiment_cpu(job_id: int, token: str, study_id: int | None = None) -> str:
    """Run one node attempt on the cpu queue."""
    return _job(job_id, token, study_id, _experiment)


@app.task(name="gpu.experiment")
def experiment_gpu(job_id: int, token: str, study_id: int | None = None) -> str:
    """Run one node attempt on the gpu queue."""
    return _job(job_id, token, study_id, _experiment)


@app.task(name="cpu.sealed")
def sealed_cpu(job_id: int, token: str, study_id: int | None = None) -> str:
    """Run a study's baseline or gate evaluation on the cpu queue."""
    return _job(job_id, token, study_id, _sealed)


@app.task(name="gpu.sealed")
def sealed_gpu(job_id: int, token: str, study_id: int | None = None) -> str:
    """Run a GPU study's baseline or gate evaluation on the gpu queue."""
    return _job(job_id, token, study_id, _sealed)


@app.task(name="gpu.learn", bind=True, max_retries=None)
def learn(self: Task, job_id: int, token: str = "") -> str:
    """Run a learning-module job (self-distillation or a sparse-attention evaluation).

    A worker on another machine runs it through the API with the job's token; a task sent before
    learning jobs had tokens goes back to the queue for a worker beside the database.
    """
    settings = get_settings()
    store: learning.LearningStore | None = None
    if settings.worker_token:
        if not token:
            print(f"learning job {job_id} has no token: it needs a gpu worker beside the database")
            raise self.retry(countdown=60)
        store = remote.ApiLearningStore(remote.site(settings), job_id, token)
    try:
        with lease(settings.redis_url, f"grove:learning:{job_id}", settings.lease_seconds):
            return learning.run(settings, job_id, store)
    except Busy:
        return "running elsewhere"
    except Superseded:
        return "superseded"  # not this token's job (any more): nothing was written
    except remote.RemoteError as exc:  # the API is out of reach: the job runs again once it is back
        print(f"learning job {job_id}: {exc}; tried again in 30 s")
        raise self.retry(countdown=30) from None


def waiting_tasks(r: redis.Redis) -> set[str]:
    """Return the ids of the tasks whose messages wait in a job queue of the broker (Celery's Redis lists)."""
    out: set[str] = set()
    for queue in JOB_QUEUES:
        for key in (queue, *(f"{queue}\x06\x16{p}" for p in (3, 6, 9))):  # kombu's priority lists too
            for raw in r.lrange(key, 0, -1):
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    out.add(str(json.loads(raw)["headers"]["id"]))
    return out


@app.task(name="coordinator.reconcile")
def reconcile() -> dict[str, int]:
    """Re-send jobs whose task was lost and nudge every active study forward."""
    settings = get_settings()
    r = client(settings.redis_url)
    if not r.set("grove:reconcile", "1", nx=True, ex=max(1, int(settings.reconcile_seconds * 0.7))):
        return {"skipped": 1}
    dispatcher = CeleryDispatcher(settings, app)
    resent = nudged = 0
    with db.session(settings.db_url) as s:
        active = [
            st.id
            for st in s.exec(
                select(Study).where(col(Study.status).in_([StudyStatus.RUNNING, StudyStatus.STOPPING]))
            )
        ]
        # A created study whose first advance was lost (the broker was away when the API sent it, or
        # the step failed before the study started) is started here; the API's own advance comes first.
        active += [
            st.id
            for st in s.exec(select(Study).where(Study.status == StudyStatus.CREATED, Study.repo_path != ""))
            if (now() - st.created_at).total_seconds() > settings.reconcile_seconds
        ]
        # A clone whose task was lost (broker or worker died) is sent again, once a minute at most.
        cloning = [
            st.id
            for st in s.exec(select(Study).where(Study.status == StudyStatus.CLONING))
            if (now() - st.created_at).total_seconds() > settings.lease_seconds
            and not r.exists(f"grove:clone:{st.id}")
            and r.set(f"grove:resent-clone:{st.id}", "1", nx=True, ex=60)
        ]
        stale = []
        jobs = list(s.exec(select(Job).where(col(Job.status).in_(["queued", "running"]))))
        # A job is lost only when nothing holds it: no worker's lease, and, while queued, no message
        # of its attempt waiting in a queue (a job waiting for a free slot is not lost, however long).
        waiting = waiting_tasks(r) if any(j.status == JobStatus.QUEUED for j in jobs) else set()
        for job in jobs:
            age = (now() - (job.started_at or job.created_at)).total_seconds()
            held = r.exists(f"grove:job:{job.id}") or (
                job.status == JobStatus.QUEUED and job.task_id in waiting
            )
            # A re-sent duplicate is harmless (job lease + status check) but not free: once per 5 min.
            if (
                not held
                and age > settings.lease_seconds
                and r.set(f"grove:resent:{job.id}", "1", nx=True, ex=300)
            ):
                stale.append(job.id)
    for job_id in stale:
        if job_id is not None:
            dispatcher.submit(job_id)
            resent += 1
    for study_id in cloning:
        app.send_task(CLONE_TASK, args=[study_id])
        resent += 1
    for study_id in active:
        if study_id is not None and not r.exists(f"grove:study:{study_id}"):
            enqueue_advance(app, study_id)
            nudged += 1
    return {"resent": resent, "nudged": nudged}
