"""Per-token divergences between student p and teacher q (forward KL, reverse KL and the generalised JSD between them).

forward KL(q‖p), reverse KL(p‖q), and the generalised JSD_β = β·KL(q‖M) + (1−β)·KL(p‖M) with
M = β·q + (1−β)·p (GKD convention); β = 0 and β = 1 are special-cased to the forward and reverse
KL, as in SDPO and TRL. Supports: the full vocabulary, the student's top-K plus a tail bucket,
and the sampled token (reverse KL only, as REINFORCE with reward −(log p − log q)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agents.learning.options import Support


@dataclass(frozen=True)
class DistillConfig:
    beta: float = 0.5  # 0: forward KL, 1: reverse KL, between: generalised JSD
    support: Support = Support.TOPK
    topk: int = 100
    add_tail: bool = True
    is_clip: float | None = 2.0
    temperature: float = 1.0


def divergence(logp: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
    """Return the divergence over the last dim between student log-probs and teacher log-probs."""
    if beta == 0.0:
        return (logq.exp() * (logq - logp)).sum(-1)
    if beta == 1.0:
        return (logp.exp() * (logp - logq)).sum(-1)
    logm = torch.logsumexp(torch.stack([logq + math.log(beta), logp + math.log(1 - beta)]), dim=0)
    kl_qm = (logq.exp() * (logq - logm)).sum(-1)
    kl_pm = (logp.exp() * (logp - logm)).sum(-1)
    return beta * kl_qm + (1 - beta) * kl_pm


def _with_tail(logp_k: torch.Tensor) -> torch.Tensor:
    """Append the tail bucket log(1 − Σ p_k), computed stably."""
    lse = torch.logsumexp(logp_k, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp_k, torch.log(-torch.expm1(lse))], dim=-1)


def topk_supports(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, k: int, add_tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return both distributions restricted to the student's top-K tokens (+ tail, or renormalised)."""
    idx = student_logp.topk(min(k, student_logp.shape[-1]), dim=-1).indices
    p_k, q_k = student_logp.gather(-1, idx), teacher_logp.gather(-1, idx)
    if add_tail:
        return _with_tail(p_k), _with_tail(q_k)
    return torch.log_softmax(p_k, -1), torch.log_softmax(q_k, -1)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    cfg: DistillConfig = DistillConfig(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean distillation loss over [B, T, V] logits; the teacher never gets gradient."""
    teacher_logits = teacher_logits.detach()
    acc = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(student_logits.to(acc) / cfg.temperature, dim=-1)
    logq = torch.log_softmax(teacher_logits.to(acc) / cfg.temperature, dim=-1)
    m = mask.to(acc)
    if sample_mask is not None:
        m = m * sample_mask.to(acc)[:, None]
    logp_y = logp.gather(-1, tokens[..., None]).squeeze(-1)
    if cfg.support == Support.SAMPLED:
        if cfg.beta != 1.0:
            raise ValueError("the sampled-token support is defined for the reverse KL only (beta = 1)")
        logq_y = logq.gather(-1, tokens[..., None]).squeeze(-1)
        per_token = (logp_y - logq_y).detach() * logp_y
    elif cfg.support == Support.TOPK:
        per_token = divergence(*topk_supports(logp, logq, cfg.topk, cfg.add_tail), cfg.beta)
    else:
        per_token = divergence(logp, logq, cfg.beta)
    weight = torch.ones_like(per_token)
    if old_logp is not None and cfg.is_clip is not None:
        ratio = torch.exp((logp_y - old_logp.to(acc)).clamp(-20, 20)).detach()
        weight = ratio.clamp(max=cfg.is_clip)
    loss = (per_token * weight * m).sum() / m.sum().clamp_min(1.0)
    count = m.sum().clamp_min(1.0)
    return loss, {
        "tokens": float(m.sum()),
        "mean_divergence": float((per_token.detach() * m).sum() / count),
        "is_weight": float((weight * m).sum() / count),  # 1.0 on the rollouts' own policy
    }
