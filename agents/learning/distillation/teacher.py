"""Teacher regularisers for self-distillation: an EMA of the student, or trust-region mixing."""

from __future__ import annotations

import copy

import torch
from torch import nn


class EmaTeacher:
    """θ_T ← (1 − a)·θ_T + a·θ after each optimizer step; the teacher never trains."""

    def __init__(self, student: nn.Module, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        self.rate = rate
        self.model = copy.deepcopy(student).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def step(self, student: nn.Module) -> None:
        """Move the teacher toward the student (call after optimizer.step())."""
        for t, s in zip(self.model.parameters(), student.parameters(), strict=True):
            t.lerp_(s.detach(), self.rate)
        self.updates += 1


def trust_region_logits(z_ref: torch.Tensor, z_student: torch.Tensor, rate: float) -> torch.Tensor:
    """Mix the initial model's logits with the current ones: softmax of this ∝ q_ref^(1−a)·q^a."""
    return torch.lerp(z_ref.detach(), z_student.detach(), rate)
