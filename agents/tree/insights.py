"""Insight back-propagation: every ancestor of a finished node gets a new insight version."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from agents.tree.model import Tree, TreeNode

Synthesizer = Callable[[TreeNode, list[TreeNode]], str]

INSIGHT_WORDS = 150  # what the insight writer is asked for ("at most 150 words")
INSIGHT_CHARS = 1200  # and what 150 words take at most, whatever the words


def bounded(text: str, words: int = INSIGHT_WORDS, chars: int = INSIGHT_CHARS) -> str:
    """Return an insight cut to `words` words and `chars` characters, marked "…" where it was cut.

    Every insight goes into the prompts of its node's descendants: it is bounded when written.
    """
    text = text.strip()
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    end = min(len(text), ends[words - 1] if len(ends) > words else len(text), chars - 1)
    return text if end >= len(text) else text[:end].rstrip() + "…"


@dataclass(frozen=True)
class InsightUpdate:
    node_id: int
    text: str
    cites: tuple[int, ...]


def backpropagate(tree: Tree, leaf_id: int, synthesize: Synthesizer) -> list[InsightUpdate]:
    """Return new insight versions for each ancestor of `leaf_id`, nearest first.

    Each version is synthesised from the insights of the ancestor's children as they stand
    after the lower levels were updated, and cites those children's ids. Versions are
    appended, never overwritten, so a lesson cannot silently drift; each is `bounded`.
    """
    current = dict(tree.nodes)
    updates: list[InsightUpdate] = []
    for ancestor in tree.ancestors(leaf_id):
        kids = [current[c.id] for c in tree.children(ancestor.id) if current[c.id].insight]
        if not kids:
            continue
        text = bounded(synthesize(current[ancestor.id], kids))
        if not text or text == current[ancestor.id].insight:
            continue
        updates.append(InsightUpdate(ancestor.id, text, tuple(k.id for k in kids)))
        old = current[ancestor.id]
        current[ancestor.id] = replace(old, insight=text)
    return updates
