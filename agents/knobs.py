"""Probe a study's `[search]` knobs: move each one far, run dev, and see whether any metric moves.

A knob the evaluator never reads (a default nobody passes on, the learning rate of an optimizer
that is not in use) makes every experiment that edits it a silent no-op. `probes` builds, for each
knob, the file texts with that knob moved to the far end of its range (or another of its values);
a conditional knob is probed with its condition met, against a reference run that meets the
condition but leaves the knob alone. `moved` compares two runs' metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents import configfiles
from agents.spec import SearchDim, Spec


@dataclass(frozen=True)
class Probe:
    """One knob moved: the texts of the files it changes, and those of its reference run."""

    key: str
    before: Any
    after: Any
    texts: dict[str, str]
    reference: dict[str, str] = field(default_factory=dict)  # empty: the base itself


def far_value(dim: SearchDim, current: Any) -> Any:
    """Return the value of `dim` farthest from `current`: a range's far end, or another value."""
    if dim.values is not None:
        others = [v for v in dim.values if v != current]
        return others[0] if others else dim.values[0]
    low, high = float(dim.low or 0.0), float(dim.high or 0.0)
    if isinstance(current, bool) or not isinstance(current, int | float):
        pick = high
    elif dim.log and current > 0:
        pick = low if math.log(current / low) > math.log(high / current) else high
    else:
        pick = low if current - low > high - current else high
    whole = (
        dim.integer if dim.integer is not None else isinstance(current, int) and not isinstance(current, bool)
    )
    return int(round(pick)) if whole else pick


def _edit(spec: Spec, read: Callable[[str], str], texts: dict[str, str], key: str, value: Any) -> None:
    for file, dotted in spec.targets(key):
        text = texts[file] if file in texts else read(file)
        texts[file] = configfiles.set_keys(file, text, {dotted: value}, spec.files.formats.get(file))


def probes(spec: Spec, read: Callable[[str], str]) -> list[Probe]:
    """Return one probe per `[search]` knob whose current value can be read, in spec order."""
    out = []
    for key, dim in spec.search.items():
        try:
            current = spec.value_at(key, read)
            after = far_value(dim, current)
            reference: dict[str, str] = {}
            for parent, allowed in sorted(dim.when.items()):
                wanted = allowed[0] if isinstance(allowed, list) else allowed
                now = spec.value_at(parent, read)
                if now != wanted and not (isinstance(allowed, list) and now in allowed):
                    _edit(spec, read, reference, parent, wanted)
            texts = dict(reference)
            _edit(spec, read, texts, key, after)
        except (KeyError, ValueError, OSError):
            continue
        out.append(Probe(key, current, after, texts, reference))
    return out


def moved(base: dict[str, Any] | None, probed: dict[str, Any] | None) -> bool:
    """Return whether any metric differs between two runs (a run with no metrics counts as a change)."""
    if not base or not probed:
        return True
    return any(probed.get(k) != v for k, v in base.items()) or set(probed) != set(base)
