"""Scalable-softmax (SSMax): softmax(s · log N · z), N the number of keys a row may see."""

from __future__ import annotations

import torch


def ssmax_softmax(
    scores: torch.Tensor, s: float | torch.Tensor, n_visible: torch.Tensor | None = None
) -> torch.Tensor:
    """Return softmax over the last dim of `scores * s * log(n)`; masked entries must be -inf.

    `n_visible` (broadcastable to scores[..., :1]) counts the keys each row can see; by default
    the finite entries are counted. Rows that see one key are unchanged (their weight is 1).
    """
    if n_visible is None:
        n_visible = torch.isfinite(scores).sum(dim=-1, keepdim=True)
    n = n_visible.to(scores.dtype).clamp_min(1.0)
    factor = s * torch.log(n)
    factor = torch.where(n > 1, factor, torch.ones_like(factor))
    return torch.softmax(scores * factor, dim=-1)
