"""On-policy self-distillation losses: divergences on three supports, teacher regularisers, OPSA."""

from agents.learning.distillation.losses import DistillConfig, distill_loss, divergence
from agents.learning.distillation.opsa import opsa_advantages, opsa_loss
from agents.learning.distillation.teacher import EmaTeacher, trust_region_logits

__all__ = [
    "DistillConfig",
    "EmaTeacher",
    "distill_loss",
    "divergence",
    "opsa_advantages",
    "opsa_loss",
    "trust_region_logits",
]
