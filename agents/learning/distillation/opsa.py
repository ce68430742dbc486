"""OPSA (arXiv 2608.31046): no teacher; negative advantages on the lowest-log-prob tokens, by entropy.

The K = max(1, ⌊f·N⌋) valid tokens with the smallest log-prob (stable order, pooled over the
whole batch) get A = A_max + (A_min − A_max)·r with r the entropy rescaled to [0, 1] over the
selected set (r = 1 when the entropies are equal), so A ∈ [A_min, A_max] and is most negative at
the highest entropy; every other token gets 0 and leaves the loss's denominator.
"""

from __future__ import annotations

import torch


def opsa_advantages(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    fraction: float = 0.2,
    a_min: float = -1.0,
    a_max: float = -0.5,
    fixed: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Return (advantages, selection mask, metrics), all shaped like `logp`."""
    if logp.shape != entropy.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, entropy {tuple(entropy.shape)}, mask {tuple(mask.shape)}"
        )
    flat_valid = mask.reshape(-1).bool()
    n = int(flat_valid.sum())
    adv = torch.zeros_like(logp)
    sel = torch.zeros_like(mask, dtype=torch.bool)
    if n == 0:
        return adv, sel, {"selected": 0.0, "valid": 0.0}
    k = max(1, int(fraction * n))
    valid_idx = flat_valid.nonzero().squeeze(-1)
    order = torch.sort(logp.detach().reshape(-1)[valid_idx], stable=True).indices[:k]
    chosen = valid_idx[order]
    sel.view(-1)[chosen] = True
    if fixed is not None:
        adv.view(-1)[chosen] = fixed
    else:
        h = entropy.detach().reshape(-1)[chosen]
        span = h.max() - h.min()
        r = torch.ones_like(h) if span <= 1e-12 else (h - h.min()) / span
        adv.view(-1)[chosen] = (a_max + (a_min - a_max) * r).to(adv.dtype)
    return adv, sel, {"selected": float(k), "valid": float(n)}


def opsa_loss(logp: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Return −(1/|S|)·Σ_{i∈S} A_i·log π(y_i) (PPO surrogate with ratio 1, one step per rollout)."""
    count = selected.sum().clamp_min(1)
    return -(advantages.detach() * logp * selected).sum() / count
