"""Lab memory: list, inspect and delete what finished studies left for later ones."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status

from backend.api import schemas
from backend.api.deps import MAX_ID, Operator, Reader, SessionDep, StudyId
from backend.api.routes.studies import get_study
from backend.core.models import MemoryEntry
from backend.services import memory

router = APIRouter(tags=["memory"])
EntryId = Annotated[int, Path(ge=1, le=MAX_ID, description="a memory entry id")]


def public(e: MemoryEntry) -> schemas.MemoryEntryPublic:
    """Return an entry as the API shows it."""
    return schemas.MemoryEntryPublic(
        id=e.id or 0, kind=e.kind, text=e.text, repository=e.repository, objective=e.objective, name=e.name,
        study_id=e.study_id, study_name=e.study_name, node_numbers=list(e.node_numbers), dev_effect=e.dev_effect,
        diff=e.diff, provenance=memory.provenance(e), created_at=e.created_at,
    )  # fmt: skip


@router.get("/memory", response_model=list[schemas.MemoryEntryPublic])
def list_entries(
    s: SessionDep,
    who: Reader,
    study: Annotated[str | None, Query(max_length=200, description="entries left by this study")] = None,
    repository: Annotated[str | None, Query(max_length=200, description="a repository key")] = None,
    name: Annotated[str | None, Query(max_length=64, description="a named memory")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[schemas.MemoryEntryPublic]:
    """List memory entries, newest first, optionally of one study, repository or named memory."""
    return [public(e) for e in memory.entries(s, study, repository, name, limit)]


@router.get("/memory/{entry_id}", response_model=schemas.MemoryEntryPublic)
def read_entry(entry_id: EntryId, s: SessionDep, who: Reader) -> schemas.MemoryEntryPublic:
    """Return one memory entry."""
    e = s.get(MemoryEntry, entry_id)
    if e is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no memory entry with id {entry_id}")
    return public(e)


@router.delete("/memory/{entry_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_entry(entry_id: EntryId, s: SessionDep, who: Operator) -> None:
    """Forget one memory entry: no later study is given it."""
    e = s.get(MemoryEntry, entry_id)
    if e is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no memory entry with id {entry_id}")
    s.delete(e)


@router.get("/studies/{study_id}/memory", response_model=list[schemas.MemoryEntryPublic])
def study_memory(study_id: StudyId, s: SessionDep, who: Reader) -> list[schemas.MemoryEntryPublic]:
    """Return what Grove already knew for a study: the entries its ideator is given, best first."""
    return [public(e) for e in memory.relevant(s, get_study(s, study_id))]
