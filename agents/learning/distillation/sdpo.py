"""SDPO and CANON training steps over a Hugging Face causal LM.

The student sees the prompt and its own rollout; the teacher is the same model (an EMA of it, a
trust-region mix with the initial model, or a frozen snapshot) that also sees privileged text —
the rollout's textual feedback for SDPO, the majority-vote consensus answer for CANON — before
the same rollout tokens. The loss is the per-token divergence on the rollout tokens only.

Records are what `grove export-trajectories` writes: `prompt` and `rollout` are chat messages
(or plain strings) and `feedback` is text. A sampled record (`online.py`) carries its rollout as
`rollout_ids`, the exact tokens the student sampled, with their `behaviour_logp`.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from agents.learning.distillation.losses import DistillConfig, distill_loss, divergence
from agents.learning.distillation.opsa import opsa_advantages, opsa_loss
from agents.learning.distillation.teacher import EmaTeacher, trust_region_logits
from agents.learning.options import Method, Teacher

FEEDBACK_HEADER = "\n\nFeedback on an earlier attempt:\n"
CONSENSUS_HEADER = "\n\nAn answer most attempts agreed on:\n"


def as_text(part: Any) -> str:
    """Render a record's prompt or rollout (chat messages or a string) as plain text."""
    if isinstance(part, str):
        return part
    lines = []
    for m in part:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content)
        if m.get("tool_calls"):
            content = (content or "") + json.dumps(m["tool_calls"])
        lines.append(f"{m.get('role', 'user')}: {content}")
    return "\n".join(lines) + "\n"


def consensus(answers: Sequence[str]) -> str:
    """Return the majority-vote answer (ties: the earliest among the most common)."""
    if not answers:
        raise ValueError("consensus needs at least one answer")
    counts = Counter(a.strip() for a in answers)
    best = max(counts.values())
    return next(a.strip() for a in answers if counts[a.strip()] == best)


def canon_records(groups: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Give every rollout of a prompt the group's consensus answer as its privileged context."""
    out = []
    for group in groups:
        agreed = consensus([as_text(r["rollout"]) for r in group])
        out += [{**r, "feedback": agreed} for r in group]
    return out


@dataclass
class Batch:
    student_ids: torch.Tensor  # [B, Ls]
    student_mask: torch.Tensor
    teacher_ids: torch.Tensor  # [B, Lt]
    teacher_mask: torch.Tensor
    student_pos: torch.Tensor  # [B, R]: the student position that predicts each rollout token
    teacher_pos: torch.Tensor  # [B, R]
    tokens: torch.Tensor  # [B, R]: the rollout tokens
    rollout_mask: torch.Tensor  # [B, R]
    old_logp: torch.Tensor | None = None  # [B, R]: the behaviour policy's log-probs of sampled rollouts


def build_batch(
    tokenizer: Any, records: Sequence[dict[str, Any]], header: str = FEEDBACK_HEADER, max_tokens: int = 1024
) -> Batch:
    """Tokenise (prompt, privileged text, rollout) so both views predict the identical rollout tokens."""
    rows = []
    for r in records:
        prompt = tokenizer(as_text(r["prompt"]), add_special_tokens=False)["input_ids"]
        feedback = str(r.get("feedback", ""))
        extra = tokenizer(header + feedback, add_special_tokens=False)["input_ids"]
        if "rollout_ids" in r:
            rollout = list(r["rollout_ids"])
        else:
            rollout = tokenizer(as_text(r["rollout"]), add_special_tokens=False)["input_ids"]
        if not rollout:
            raise ValueError("a record has an empty rollout")
        room = max_tokens - len(prompt)
        budget = room - min(len(rollout), max(1, room // 2))  # the rollout keeps half the room
        if len(extra) > budget:  # the feedback keeps its end (where errors are), after the header
            head = tokenizer(header, add_special_tokens=False)["input_ids"]
            tail = tokenizer(feedback, add_special_tokens=False)["input_ids"]
            keep = max(0, budget - len(head))
            extra = head + (tail[-keep:] if keep else [])
        rollout = rollout[: max(1, room - len(extra))]  # and its end is cut
        rows.append((prompt, extra, rollout))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ls = max(len(p) + len(o) for p, _, o in rows)
    lt = max(len(p) + len(e) + len(o) for p, e, o in rows)
    lr = max(len(o) for _, _, o in rows)
    b = len(rows)
    out = Batch(
        torch.full((b, ls), pad), torch.zeros(b, ls, dtype=torch.long),
        torch.full((b, lt), pad), torch.zeros(b, lt, dtype=torch.long),
        torch.zeros(b, lr, dtype=torch.long), torch.zeros(b, lr, dtype=torch.long),
        torch.full((b, lr), pad), torch.zeros(b, lr, dtype=torch.bool),
    )  # fmt: skip
    for i, (p, e, o) in enumerate(rows):
        s_ids, t_ids = p + o, p + e + o
        out.student_ids[i, : len(s_ids)] = torch.tensor(s_ids)
        out.student_mask[i, : len(s_ids)] = 1
        out.teacher_ids[i, : len(t_ids)] = torch.tensor(t_ids)
        out.teacher_mask[i, : len(t_ids)] = 1
        n = len(o)
        # Position j predicts token j+1; the first rollout token is predicted by the prompt's last position.
        out.student_pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        out.teacher_pos[i, :n] = torch.arange(len(p) + len(e) - 1, len(p) + len(e) - 1 + n)
        out.tokens[i, :n] = torch.tensor(o)
        out.rollout_mask[i, :n] = True
    if all("behaviour_logp" in r for r in records):
        out.old_logp = torch.zeros(b, lr, dtype=torch.float32)
        for i, r in enumerate(records):
            n = len(rows[i][2])
            out.old_logp[i, :n] = torch.tensor(r["behaviour_logp"][:n], dtype=torch.float32)
    if (out.student_pos < 0).any():
        raise ValueError(
            "a record has an empty prompt: the first rollout token has no position to predict it"
        )
    return out


def _rollout_logits(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids=ids, attention_mask=mask).logits
    return logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))


@dataclass
class SdpoConfig:
    mode: Method = Method.SDPO
    teacher: Teacher = Teacher.EMA
    rate: float = 0.05  # EMA rate, or the trust-region mixing weight of the current model
    distill: DistillConfig = field(default_factory=DistillConfig)
    opsa_weight: float = 0.0  # > 0 adds OPSA's negative-advantage term on the student's own tokens
    opsa_fraction: float = 0.2  # OPSA: the share of lowest-log-prob tokens that get a negative advantage
    opsa_a_min: float = -1.0
    opsa_a_max: float = -0.5
    max_tokens: int = 1024
    header: str | None = None  # text before the privileged context; None: the mode's default

    def __post_init__(self) -> None:
        if self.mode == Method.CANON and self.teacher != Teacher.FROZEN:
            raise ValueError("CANON uses a frozen teacher snapshot: set teacher = 'frozen'")


class SelfDistiller:
    """Own the teacher and run SDPO/CANON steps on a student causal LM."""

    def __init__(self, student: nn.Module, tokenizer: Any, cfg: SdpoConfig) -> None:
        self.student, self.tokenizer, self.cfg = student, tokenizer, cfg
        self.ema = EmaTeacher(student, cfg.rate) if cfg.teacher == Teacher.EMA else None
        self.reference: nn.Module | None = None
        if cfg.teacher in (Teacher.TRUST_REGION, Teacher.FROZEN):
            self.reference = copy.deepcopy(student).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    def _teacher_logits(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            if self.ema is not None:
                return _rollout_logits(
                    self.ema.model, batch.teacher_ids, batch.teacher_mask, batch.teacher_pos
                )
            assert self.reference is not None
            ref = _rollout_logits(self.reference, batch.teacher_ids, batch.teacher_mask, batch.teacher_pos)
            if self.cfg.teacher == Teacher.FROZEN:
                return ref
            was_training = self.student.training
            self.student.eval()
            cur = _rollout_logits(self.student, batch.teacher_ids, batch.teacher_mask, batch.teacher_pos)
            self.student.train(was_training)
            return trust_region_logits(ref, cur, self.cfg.rate)

    def _batch(self, records: Sequence[dict[str, Any]]) -> Batch:
        header = self.cfg.header
        if header is None:
            header = CONSENSUS_HEADER if self.cfg.mode == Method.CANON else FEEDBACK_HEADER
        batch = build_batch(self.tokenizer, records, header, self.cfg.max_tokens)
        device = next(self.student.parameters()).device
        for name in batch.__dataclass_fields__:
            value = getattr(batch, name)
            if value is not None:
                setattr(batch, name, value.to(device))
        return batch

    def loss(self, records: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, float]]:
        """Return the loss on a batch of records and its diagnostics (no optimizer step)."""
        batch = self._batch(records)
        teacher = self._teacher_logits(batch)
        student = _rollout_logits(self.student, batch.student_ids, batch.student_mask, batch.student_pos)
        loss, diag = distill_loss(
            student, teacher, batch.tokens, batch.rollout_mask, old_logp=batch.old_logp, cfg=self.cfg.distill
        )
        if self.cfg.opsa_weight > 0:
            c = self.cfg
            logp_all = torch.log_softmax(student.float() / self.cfg.distill.temperature, -1)
            logp = logp_all.gather(-1, batch.tokens[..., None]).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            adv, sel, _ = opsa_advantages(
                logp, entropy, batch.rollout_mask, c.opsa_fraction, c.opsa_a_min, c.opsa_a_max
            )
            diag["opsa"] = float(opsa_loss(logp, adv, sel).detach())
            loss = loss + c.opsa_weight * opsa_loss(logp, adv, sel)
        diag["loss"] = float(loss.detach())
        return loss, diag

    def divergence(self, records: Sequence[dict[str, Any]], chunk: int = 8) -> float:
        """Return the mean full-vocabulary teacher–student divergence (at β and T) per rollout token."""
        was_training = self.student.training
        self.student.eval()
        t, total, count = self.cfg.distill.temperature, 0.0, 0.0
        with torch.no_grad():
            for start in range(0, len(records), chunk):
                batch = self._batch(records[start : start + chunk])
                teacher = torch.log_softmax(self._teacher_logits(batch).float() / t, -1)
                student = _rollout_logits(
                    self.student, batch.student_ids, batch.student_mask, batch.student_pos
                )
                per_token = divergence(
                    torch.log_softmax(student.float() / t, -1), teacher, self.cfg.distill.beta
                )
                m = batch.rollout_mask.float()
                total, count = total + float((per_token * m).sum()), count + float(m.sum())
        self.student.train(was_training)
        return total / max(count, 1.0)

    def step(self, records: Sequence[dict[str, Any]], optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Run one optimizer step on a batch of records; return the diagnostics."""
        self.student.train()
        optimizer.zero_grad(set_to_none=True)
        loss, diag = self.loss(records)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        diag["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0))
        optimizer.step()
        if self.ema is not None:
            self.ema.step(self.student)
        return diag
