"""Bad input that one field of a request holds: the base of the refusals that name their field."""

from __future__ import annotations


class FieldError(ValueError):
    """A refusal of one field's value: `key` names the field (dotted), `detail` says what is wrong."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail
