"""One status palette for the tree and every chart: the same status is the same colour everywhere."""

from __future__ import annotations

from typing import Any

STATUS = {
    "proposed": "#d9d9d9",
    "queued": "#fff3b0",
    "running": "#ffd166",
    "evaluated": "#a8dadc",
    "awaiting_approval": "#f4a261",
    "merged": "#57cc99",
    "rejected": "#e5989b",
    "failed": "#e63946",
    "pruned": "#9e9e9e",
    "cancelled": "#cfcfcf",
}


# A gain's colour, worse to better, in the tree and the parallel coordinates alike.
GAIN_WORSE, GAIN_ZERO, GAIN_BETTER = "#d7191c", "#f7f7f7", "#2c7bb6"


def colour(status: str) -> str:
    """Return a status's colour (grey for one the palette does not know)."""
    return STATUS.get(status, "#cccccc")


def vega_colour(field: str = "status") -> dict[str, Any]:
    """Return a Vega-Lite colour encoding of `field` (a status) in this palette, with its legend."""
    return {
        "field": field,
        "type": "nominal",
        "scale": {"domain": list(STATUS), "range": list(STATUS.values())},
        "legend": {"title": "status"},
    }
