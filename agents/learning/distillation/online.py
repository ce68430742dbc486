"""On-policy SDPO rounds: the student samples, a checker gives feedback, the self-teacher distils it back.

Each round the student samples `samples` rollouts of every prompt (sampling at `temperature`, no
top-k or top-p) and keeps each token's behaviour log-prob: the log-softmax of the scores the
sampler drew from, so whatever else the model's generation config applies (a repetition penalty)
is part of the behaviour policy and the importance weights correct for it. Every rollout gets textual feedback — from the
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
from agents.learning.options import Method

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


def stop_tokens(model: Any, tokenizer: Any) -> list[int]:
    """Return the ids that end a rollout: the model's generation config's and the tokenizer's EOS."""
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [found] if isinstance(found, int) else list(found or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def sample(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    chunk: int = 8,
) -> list[Rollout]:
    """Sample `samples` rollouts of each prompt (`chunk` at a time) with their behaviour log-probs."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stops = stop_tokens(model, tokenizer)
    was_training = model.training
    model.eval()
    out: list[Rollout] = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p.text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
            for start in range(0, samples, chunk):
                gen = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                    top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                    num_return_sequences=min(chunk, samples - start), pad_token_id=pad, eos_token_id=stops or None,
                    output_scores=True, return_dict_in_generate=True,
                )  # fmt: skip
                new = gen.sequences[:, ids.shape[1] :]
                scores = torch.stack(gen.scores, dim=1).float()  # what the sampler drew from, per step
                logp = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None]).squeeze(-1)
                del gen, scores
                for row, row_logp in zip(new.tolist(), logp.tolist(), strict=True):
                    ends = [i for i, t in enumerate(row) if t in stops]
                    n = ends[0] + 1 if ends else len(row)  # after the first stop token come only pads
                    text = tokenizer.decode(row[:n], skip_special_tokens=True)
                    out.append(Rollout(p, row[:n], row_logp[:n], text))
    model.train(was_training)
    return out


def without_dropout(model: Any) -> None:
    """Switch dropout off, so the student a step trains is the policy that sampled (ratio 1 at first)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


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
    rollouts = sample(
        distiller.student,
        distiller.tokenizer,
        prompts,
        samples,
        max_new_tokens,
        temperature,
        chunk=batch_size,
    )
    give_feedback(rollouts, canon=distiller.cfg.mode == Method.CANON)
    batch_all = records(rollouts)
    if not batch_all:
        raise ValueError("every rollout of the round was empty")
    before = distiller.divergence(batch_all, chunk=batch_size)
    diags = []
    for step in range(steps):
        batch = [
            batch_all[(step * batch_size + i) % len(batch_all)]
            for i in range(min(batch_size, len(batch_all)))
        ]
        diags.append(distiller.step(batch, optimizer))
    after = distiller.divergence(batch_all, chunk=batch_size)
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
