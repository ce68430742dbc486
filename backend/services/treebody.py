"""The body of GET /tree, kept per process and rebuilt only where nodes changed.

A request reads every node's `updated_at` (an index-only scan of `ix_node_study_updated`), fetches
the summary row of each node whose stamp differs from the one kept, and writes the JSON of each
node whose fate key moved (its stamp, trunk, refine children or the spec's min_gain); the body is
the kept pieces joined in id order. A node's `number`, `origin` and `origin_ref` never change, so
the refine children are known from the kept rows. Stamps are compared for equality, not order:
clocks that disagree between machines do not hide a change.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic_core
from sqlalchemy import String, type_coerce
from sqlmodel import Session, col, select

from backend.core.models import Node, Study
from backend.services import fates
from backend.services.records import spec_of

FULL_EVERY = 600.0  # seconds after which a study's pieces are read afresh, whatever the stamps say
CACHED_STUDIES = 16
CHUNK = 500


@dataclass
class _Kept:
    lock: threading.Lock = field(default_factory=threading.Lock)
    loaded_at: float = field(default_factory=time.monotonic)
    stamps: dict[int, Any] = field(default_factory=dict)  # node -> updated_at of the row kept
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # node -> summary and fate columns
    pieces: dict[int, tuple[tuple[Any, ...], bytes]] = field(default_factory=dict)  # node -> (fate key, JSON)
    body: tuple[tuple[Any, ...], bytes] | None = None  # the last body, with what it was built from


_KEPT: OrderedDict[tuple[str, int], _Kept] = OrderedDict()
_LOCK = threading.Lock()


def _rows(s: Session, query: Any) -> list[Any]:
    return list(s.connection().execute(query).all())  # Core rows: no ORM objects at 5,000 nodes


def _kept(url: str, study_id: int) -> _Kept:
    key = (url, study_id)
    with _LOCK:
        kept = _KEPT.pop(key, None)
        if kept is None or time.monotonic() - kept.loaded_at > FULL_EVERY:
            kept = _Kept()
        _KEPT[key] = kept
        while len(_KEPT) > CACHED_STUDIES:
            _KEPT.popitem(last=False)
        return kept


def tree_body(s: Session, url: str, st: Study, fields: Sequence[str]) -> bytes:
    """Return the JSON of the study's tree: every node's `fields` and its fate, in id order."""
    assert st.id is not None
    kept = _kept(url, st.id)
    with kept.lock:
        return _body(s, url, st, list(fields), kept)


def _body(s: Session, url: str, st: Study, fields: list[str], kept: _Kept) -> bytes:
    assert st.id is not None
    stamps: dict[int, Any] = dict(
        _rows(s, select(Node.id, type_coerce(Node.updated_at, String)).where(col(Node.study_id) == st.id))
    )
    gone = kept.stamps.keys() - stamps.keys()
    for nid in gone:
        kept.stamps.pop(nid)
        kept.rows.pop(nid, None)
        kept.pieces.pop(nid, None)
    moved = sorted(nid for nid, stamp in stamps.items() if kept.stamps.get(nid) != stamp)
    trunk, min_gain = st.trunk_commit, spec_of(st).plateau.min_gain
    context = (st.trunk_node_id, trunk, min_gain)
    unchanged = not moved and not gone and len(stamps) == len(kept.rows)
    if unchanged and kept.body is not None and kept.body[0] == context:
        return kept.body[1]
    kept.body = None  # a rebuild that fails half-way leaves no body that would look current
    extra = fates.fate_columns()
    columns = [*(getattr(Node, f) for f in fields), type_coerce(Node.updated_at, String), *extra.values()]
    names = [*fields, "updated_at", *extra]
    for i in range(0, len(moved), CHUNK):
        query = select(*columns).where(col(Node.study_id) == st.id, col(Node.id).in_(moved[i : i + CHUNK]))
        for values in _rows(s, query):
            row = dict(zip(names, values, strict=True))
            # The stamp the row was read with: a write between the two queries is read next time.
            kept.stamps[row["id"]] = row.pop("updated_at")
            kept.rows[row["id"]] = row
    refs: dict[str, dict[int, list[int]]] = {"refine": {}, "revisit": {}}
    for nid in sorted(kept.rows):
        row = kept.rows[nid]
        if row["origin"] in refs and row["origin_ref"] is not None:
            refs[row["origin"]].setdefault(row["origin_ref"], []).append(row["number"])
    refined, revisited = refs["refine"], refs["revisit"]
    for nid, row in kept.rows.items():
        key = (kept.stamps[nid], trunk, tuple(refined.get(nid, ())), tuple(revisited.get(nid, ())), min_gain)
        piece = kept.pieces.get(nid)
        if piece is None or piece[0] != key:
            told = fates.node_told(row, refined.get(nid, ()), trunk, min_gain, revisited.get(nid, ()))
            summary = {f: row[f] for f in fields} | told._asdict()
            kept.pieces[nid] = (key, pydantic_core.to_json(summary, inf_nan_mode="null"))
    head = pydantic_core.to_json({"study_id": st.id, "trunk_node_id": st.trunk_node_id})
    body = b"".join(
        [head[:-1], b',"nodes":[', b",".join(kept.pieces[nid][1] for nid in sorted(kept.pieces)), b"]}"]
    )
    kept.body = (context, body)
    return body
