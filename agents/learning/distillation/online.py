"""On-policy SDPO rounds: the student samples, a checker gives feedback, the self-teacher distils it back.

Each round the student samples `samples` rollouts of every prompt (plain sampling at
`temperature`, no top-k or top-p, so the behaviour distribution is exactly softmax(logits / T))
and keeps each token's behaviour log-prob. Every rollout gets textual feedback — from the
prompt's checker, or the prompt's stored feedback — and, for CANON, the majority answer of its
prompt's rollouts instead. Then `steps` optimizer steps distil the self-teacher (the student, or
its EMA / trust-region / frozen copy, with the privileged text before the same rollout) into the
student on those rollouts; the steps after the first are off-policy, so each token's loss is
weighted by the clipped ratio of the current student's probability to the behaviour one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agents.learning.distillation.sdpo import SelfDistiller, consensus

# A prompt's checker: the rollout's text -> (passed, textual feedback); None: use stored feedback.
Checker = Callable[[str], tuple[bool, str]]


@dataclass(frozen=True)
class Prompt:
    text: str
    feedback: str = ""  # stored feedback, used when there is no checker
    check: Checker | None = None


@dataclass
class Rollout:
    prompt: Prompt
    ids: list[int]
    behaviour_logp: list[float]
    text: str
    passed: bool | None = None
    feedback: str = ""


def sample(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    samples: int,
    max_new_tokens: int,
    temperature: float,
) -> list[Rollout]:
    """Sample `samples` rollouts of each prompt with their behaviour log-probs (no gradient)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out: list[Rollout] = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p.text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, num_return_sequences=samples,
                pad_token_id=pad, eos_token_id=eos, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            new = gen.sequences[:, ids.shape[1] :]
            logits = torch.stack(gen.logits, dim=1).float() / temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
            for row, row_logp in zip(new.tolist(), logp.tolist(), strict=True):
                n = row.index(eos) + 1 if eos is not None and eos in row else len(row)
                out.append(
                    Rollout(p, row[:n], row_logp[:n], tokenizer.decode(row[:n], skip_special_tokens=True))
                )
    model.train(was_training)
    return out


def give_feedback(rollouts: Sequence[Rollout], canon: bool) -> None:
    """Set each rollout's feedback: its prompt's checker (or stored feedback), or CANON's majority answer."""
    for r in rollouts:
        if r.prompt.check is not None:
            r.passed, r.feedback = r.prompt.check(r.text)
        else:
            r.feedback = r.prompt.feedback
    if canon:
        groups: dict[str, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.prompt.text, []).append(r)
        for group in groups.values():
            agreed = consensus([r.text for r in group])
            for r in group:
                r.feedback = agreed


def records(rollouts: Sequence[Rollout]) -> list[dict[str, Any]]:
    """Return the rollouts as distillation records that keep their token ids and behaviour log-probs."""
    return [
        {
            "prompt": r.prompt.text,
            "rollout_ids": r.ids,
            "behaviour_logp": r.behaviour_logp,
            "feedback": r.feedback,
        }
        for r in rollouts
        if r.ids
    ]


def run_round(
    distiller: SelfDistiller,
    optimizer: torch.optim.Optimizer,
    prompts: Sequence[Prompt],
    *,
    samples: int,
    steps: int,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
) -> dict[str, Any]:
    """Run one round (sample, check, distil) and return what it measured."""
    rollouts = sample(distiller.student, distiller.tokenizer, prompts, samples, max_new_tokens, temperature)
    give_feedback(rollouts, canon=distiller.cfg.mode == "canon")
    batch_all = records(rollouts)
    if not batch_all:
        raise ValueError("every rollout of the round was empty")
    before = distiller.divergence(batch_all)
    diags = []
    for step in range(steps):
        batch = [
            batch_all[(step * batch_size + i) % len(batch_all)]
            for i in range(min(batch_size, len(batch_all)))
        ]
        diags.append(distiller.step(batch, optimizer))
    after = distiller.divergence(batch_all)
    checked = [r.passed for r in rollouts if r.passed is not None]
    return {
        "rollouts": len(rollouts),
        "pass_rate": sum(checked) / len(checked) if checked else None,
        "divergence_before": before,
        "divergence_after": after,
        "loss": sum(d["loss"] for d in diags) / len(diags),
        "is_weight_first": diags[0]["is_weight"],
        "is_weight_last": diags[-1]["is_weight"],
        "steps": diags,
        "samples": [
            {"text": r.text[:200], "passed": r.passed, "feedback": r.feedback[:300]} for r in rollouts[:4]
        ],
    }
