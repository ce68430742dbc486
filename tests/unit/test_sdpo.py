"""SDPO and CANON steps over a tiny Hugging Face causal LM built in the test (float64, CPU)."""

from __future__ import annotations

import pytest
import torch

from agents.learning.distillation import DistillConfig
from agents.learning.distillation.sdpo import (
    FEEDBACK_HEADER,
    SdpoConfig,
    SelfDistiller,
    as_text,
    build_batch,
    canon_records,
    consensus,
)
from tests.support.learning import records, tiny_model, tiny_tokenizer


def test_both_views_predict_the_same_rollout_tokens() -> None:
    tok = tiny_tokenizer()
    recs = records()
    b = build_batch(tok, recs)
    for i, r in enumerate(recs):
        n = int(b.rollout_mask[i].sum())
        expected = tok(as_text(r["rollout"]), add_special_tokens=False)["input_ids"]
        assert b.tokens[i, :n].tolist() == expected
        assert b.student_ids[i].gather(0, b.student_pos[i, :n] + 1).tolist() == expected
        assert b.teacher_ids[i].gather(0, b.teacher_pos[i, :n] + 1).tolist() == expected
        teacher_text = tok.decode(b.teacher_ids[i, : int(b.teacher_mask[i].sum())])
        assert r["feedback"] in teacher_text and r["feedback"] not in tok.decode(b.student_ids[i])


def test_teacher_equal_to_student_gives_zero_loss_and_gradient() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    cfg = SdpoConfig(teacher="frozen", header="", distill=DistillConfig(beta=0.5, support="full"))
    same = [{**r, "feedback": ""} for r in records()]
    loss, diag = SelfDistiller(model, tok, cfg).loss(same)
    loss.backward()
    assert abs(loss.item()) < 1e-12 and diag["tokens"] > 0
    assert max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None) < 1e-10


@pytest.mark.parametrize("teacher", ["ema", "trust_region"])
def test_sdpo_steps_pull_the_student_toward_the_feedback_conditioned_teacher(teacher: str) -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    distiller = SelfDistiller(model, tok, SdpoConfig(teacher=teacher, rate=0.05))  # type: ignore[arg-type]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = distiller.step(records(), opt)
    for _ in range(15):
        last = distiller.step(records(), opt)
    assert last["loss"] < 0.5 * first["loss"]
    assert first["grad_norm"] > 0
    if teacher == "ema":
        assert distiller.ema is not None and distiller.ema.updates == 16


def test_trust_region_with_rate_zero_is_the_initial_model() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    tr = SelfDistiller(model, tok, SdpoConfig(teacher="trust_region", rate=0.0))
    fr = SelfDistiller(model, tok, SdpoConfig(teacher="frozen"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # the student moves; the reference does not
    b = build_batch(tok, records())
    assert torch.allclose(tr._teacher_logits(b), fr._teacher_logits(b))


def test_canon_uses_the_majority_answer_and_a_frozen_teacher() -> None:
    assert consensus(["4", " 5", "4 ", "5", "4"]) == "4"
    assert consensus(["a", "b"]) == "a"
    with pytest.raises(ValueError, match="frozen"):
        SdpoConfig(mode="canon", teacher="ema")
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    d = SelfDistiller(
        model, tok, SdpoConfig(mode="canon", teacher="frozen", distill=DistillConfig(support="full"))
    )
    group = [{"prompt": "2+2=", "rollout": r, "feedback": ""} for r in ("4", "5", "4")]
    recs = canon_records([group])
    assert [r["feedback"] for r in recs] == ["4", "4", "4"]
    frozen = [p.clone() for p in d.reference.parameters()]  # type: ignore[union-attr]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d.step(recs, opt)
    assert all(torch.equal(a, b) for a, b in zip(frozen, d.reference.parameters(), strict=True))  # type: ignore[union-attr]


def test_long_feedback_keeps_its_end_and_the_rollout_keeps_half_the_room() -> None:
    tok = tiny_tokenizer()
    record = {"prompt": "p:", "rollout": "r" * 100, "feedback": "x" * 300 + " ERROR: the answer is 4"}
    batch = build_batch(tok, [record], max_tokens=160)
    teacher = tok.decode(batch.teacher_ids[0][batch.teacher_mask[0].bool()])
    assert batch.teacher_mask[0].sum() <= 160
    assert teacher.startswith("p:" + FEEDBACK_HEADER) and "ERROR: the answer is 4" in teacher
    assert int(batch.rollout_mask[0].sum()) == (160 - 2) // 2  # the rollout's first half of the room
    assert "x" * 300 not in teacher  # the start of the feedback went
    # A sampled record: its own tokens and behaviour log-probs, cut to the same length.
    sampled = {"prompt": "p:", "rollout_ids": [5] * 100, "behaviour_logp": [-0.5] * 100, "feedback": "ok"}
    batch = build_batch(tok, [sampled], max_tokens=80)
    n = int(batch.rollout_mask[0].sum())
    assert batch.old_logp is not None and batch.tokens[0, :n].tolist() == [5] * n
    assert batch.old_logp[0, :n].tolist() == [-0.5] * n and n == 80 - 2 - len(
        tok(FEEDBACK_HEADER + "ok")["input_ids"]
    )
