"""Events: the record of everything that happened to a study, as a page or a live stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, status
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlmodel import Session, col, select

from backend.api import schemas, serializers
from backend.api.deps import Cursor, Reader, SessionDep, SettingsDep, StudyId
from backend.api.routes.studies import get_study
from backend.core import db, fanout
from backend.core.config import Settings
from backend.core.models import Event, now

router = APIRouter(prefix="/studies/{study_id}", tags=["events"])
ENDS = frozenset({"study.finished", "study.failed"})  # a stream closes once it has sent one and is drained
LATE = timedelta(seconds=30)  # how long after its stamp an event's transaction may still commit


def _page(
    s: Session, study_id: int, after: int, limit: int, newest: bool = False
) -> list[schemas.EventPublic]:
    return [serializers.event_public(e) for e in serializers.events_after(s, study_id, after, limit, newest)]


def _poll(
    settings: Settings, study_id: int, after: int, floor: int, sent: set[int]
) -> list[schemas.EventPublic]:
    """Return the events after `after`, and before them any written in the last `LATE` not yet sent.

    PostgreSQL gives an event its id when it is inserted, not when its transaction commits: an
    event may appear after others with higher ids were already sent. Such a late event is sent
    when it appears (the stream's ids are then not in order). Only ids above `floor` are looked
    at: where the client asked to start, or what the stream sent long enough ago that nothing
    below it can still commit.
    """
    with db.session(settings.db_url) as s:
        late = s.exec(
            select(Event)
            .where(Event.study_id == study_id, col(Event.id) > floor, col(Event.id) <= after)
            .where(col(Event.time) >= now() - LATE)
            .order_by(col(Event.id))
        )
        missed = [serializers.event_public(e) for e in late if e.id not in sent]
        return missed + _page(s, study_id, after, 500)


@router.get("/events/log", response_model=list[schemas.EventPublic])
def event_log(
    study_id: StudyId,
    s: SessionDep,
    who: Reader,
    after: Cursor = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    tail: Annotated[int | None, Query(ge=1, le=1000, description="return only the newest N events")] = None,
) -> list[schemas.EventPublic]:
    """Return the study's events after an id (or the newest `tail` of them), oldest first."""
    get_study(s, study_id)
    if tail is not None:
        return _page(s, study_id, after, tail, newest=True)
    return _page(s, study_id, after, limit)


async def stream_slot(request: Request, settings: SettingsDep, who: Reader) -> AsyncIterator[None]:
    """Hold one of the caller's event-stream slots while its stream is open; 429 past the cap."""
    open_: dict[str, int] = request.app.state.sse_open
    if open_.get(who.name, 0) >= settings.sse_per_token:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"at most {settings.sse_per_token} open event streams per token",
        )
    open_[who.name] = open_.get(who.name, 0) + 1
    try:
        yield
    finally:
        open_[who.name] -= 1


@router.get("/events", response_class=EventSourceResponse)
async def stream(
    study_id: StudyId,
    s: SessionDep,
    settings: SettingsDep,
    who: Reader,
    slot: Annotated[None, Depends(stream_slot)],
    last_event_id: Annotated[str | None, Header()] = None,
    after: Cursor = 0,
) -> AsyncIterator[ServerSentEvent]:
    """Stream the study's events (server-sent events); reconnect with `Last-Event-ID` to resume.

    The stream ends once the study has finished or failed and every event up to then was sent.
    """
    get_study(s, study_id)
    # A stream lasts as long as the client stays: it must not hold the request's connection; each poll
    # below opens a short session of its own.
    s.close()
    cursor = int(last_event_id) if last_event_id and last_event_id.isdigit() else after
    pubsub = None
    with contextlib.suppress(Exception):
        pubsub = aioredis.Redis.from_url(settings.redis_url).pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(fanout.channel(study_id))
    ended = drained = False
    # Ids are given in order: one sent over 2 x LATE ago (clock skew included) bounds every id that
    # can still commit late, so the look-back reads a window, not the study's whole stream.
    settled = cursor
    sent: dict[int, float] = {}  # id -> when this stream sent it (monotonic), those above `settled`
    try:
        while True:
            page = await asyncio.to_thread(_poll, settings, study_id, cursor, settled, set(sent))
            for e in page:
                cursor, sent[e.id] = max(cursor, e.id), time.monotonic()
                ended = ended or e.type in ENDS
                yield ServerSentEvent(data=e.model_dump(mode="json"), event=e.type, id=str(e.id))
            back = time.monotonic() - 2 * LATE.total_seconds()
            old = [i for i, t in sent.items() if t < back]
            if old:
                settled = max(settled, *old)
                sent = {i: t for i, t in sent.items() if i > settled}
            if page:
                continue
            if ended:
                if drained:
                    return
                drained = True  # one more look, for an event committed just after the last one
                await asyncio.sleep(1.0)
                continue
            if pubsub is None:
                await asyncio.sleep(0.5)
                continue
            try:
                await pubsub.get_message(timeout=2.0)  # woken by a ping, or poll again after 2 s
            except Exception:
                pubsub = None
    finally:
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves aclose unannotated
