"""Reading structured answers out of model text."""

from __future__ import annotations

import json
import re
from typing import Any


def json_object(text: str) -> dict[str, Any] | None:
    """Return the first JSON object in `text` (fences, prose and trailing text around it are ignored)."""
    for m in re.finditer(r"\{", text):
        try:
            value, _ = json.JSONDecoder().raw_decode(text[m.start() :])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
