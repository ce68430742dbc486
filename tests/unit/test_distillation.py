"""Distillation math on CPU in float64, on a tiny model built here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from agents.learning.distillation import (
    DistillConfig,
    EmaTeacher,
    distill_loss,
    divergence,
    opsa_advantages,
    opsa_loss,
    trust_region_logits,
)


@pytest.fixture(autouse=True)
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def logits(seed: int, shape: tuple[int, ...] = (2, 5, 11)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) over the last dim, from probabilities, by the explicit sum."""
    return (a * (a.log() - b.log())).sum(-1)


CASES = [(s, b) for s in ("full", "topk") for b in (0.0, 0.3, 1.0)] + [("sampled", 1.0)]


@pytest.mark.parametrize(("support", "beta"), CASES)
def test_zero_loss_and_gradient_when_teacher_is_student(support: str, beta: float) -> None:
    z = logits(0).requires_grad_(True)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    cfg = DistillConfig(beta=beta, support=support, topk=4)  # type: ignore[arg-type]
    loss, _ = distill_loss(z, z.detach(), tokens, torch.ones(2, 5), cfg=cfg)
    loss.backward()
    assert abs(loss.item()) <= 1e-12
    assert z.grad is not None and z.grad.abs().max() <= 1e-12


def test_beta_endpoints_are_the_closed_form_kls_and_jsd_is_bounded() -> None:
    zp, zq = logits(2), logits(3)
    logp, logq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
    p, q = logp.exp(), logq.exp()
    torch.testing.assert_close(divergence(logp, logq, 0.0), kl(q, p), atol=1e-12, rtol=0)
    torch.testing.assert_close(divergence(logp, logq, 1.0), kl(p, q), atol=1e-12, rtol=0)
    mid = 0.5 * p + 0.5 * q
    jsd = divergence(logp, logq, 0.5)
    torch.testing.assert_close(jsd, 0.5 * kl(q, mid) + 0.5 * kl(p, mid), atol=1e-12, rtol=0)
    torch.testing.assert_close(jsd, divergence(logq, logp, 0.5), atol=1e-12, rtol=0)
    assert torch.all(jsd <= torch.log(torch.tensor(2.0)))
    small = 1e-4
    torch.testing.assert_close(divergence(logp, logq, small) / small, kl(q, p), rtol=1e-2, atol=0)


def test_gradients_match_the_closed_forms() -> None:
    z = logits(4, (3, 7)).requires_grad_(True)
    logq = torch.log_softmax(logits(5, (3, 7)), -1)
    p = torch.softmax(z, -1).detach()
    (g_fkl,) = torch.autograd.grad(divergence(torch.log_softmax(z, -1), logq, 0.0).sum(), z)
    torch.testing.assert_close(g_fkl, p - logq.exp(), atol=1e-12, rtol=0)
    (g_rkl,) = torch.autograd.grad(divergence(torch.log_softmax(z, -1), logq, 1.0).sum(), z)
    rkl = kl(p, logq.exp())
    torch.testing.assert_close(g_rkl, p * (p.log() - logq - rkl[:, None]), atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: divergence(torch.log_softmax(x, -1), logq, 0.3), (z,))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_with_k_equal_v_matches_the_full_vocabulary(beta: float) -> None:
    zs, zt = logits(6), logits(7)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    full, _ = distill_loss(zs, zt, tokens, torch.ones(2, 5), cfg=DistillConfig(beta=beta, support="full"))
    no_tail, _ = distill_loss(
        zs, zt, tokens, torch.ones(2, 5), cfg=DistillConfig(beta=beta, topk=11, add_tail=False)
    )
    tail, _ = distill_loss(
        zs, zt, tokens, torch.ones(2, 5), cfg=DistillConfig(beta=beta, topk=11, add_tail=True)
    )
    assert no_tail.item() == pytest.approx(full.item(), abs=1e-12)
    assert tail.item() == pytest.approx(full.item(), abs=1e-6)


def test_topk_gathers_the_teacher_at_the_students_indices() -> None:
    zs = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])
    zt = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])  # the teacher ranks the tokens the other way
    cfg = DistillConfig(beta=0.0, topk=2, add_tail=False)
    loss, _ = distill_loss(zs, zt, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), cfg=cfg)
    p = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    q = torch.softmax(torch.tensor([0.0, 1.0]), -1)  # teacher logits of tokens 0 and 1, not its own top 2
    assert loss.item() == pytest.approx(kl(q, p).item(), abs=1e-12)


def test_masks_importance_weights_and_an_all_masked_batch() -> None:
    zs, zt = logits(8).requires_grad_(True), logits(9)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    cfg = DistillConfig(beta=0.5, support="full")
    loss, _ = distill_loss(zs, zt, tokens, mask, sample_mask=torch.tensor([1, 0]), cfg=cfg)
    loss.backward()
    assert zs.grad is not None
    assert zs.grad[1].abs().sum() == 0 and zs.grad[0, 2:].abs().sum() == 0 and zs.grad[0, :2].abs().sum() > 0
    nothing, _ = distill_loss(zs, zt, tokens, torch.zeros(2, 5), cfg=cfg)
    assert nothing.item() == 0.0
    logp_y = torch.log_softmax(zs.detach(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    same, _ = distill_loss(zs, zt, tokens, mask, old_logp=logp_y, cfg=cfg)
    plain, _ = distill_loss(zs, zt, tokens, mask, cfg=DistillConfig(beta=0.5, support="full", is_clip=None))
    assert same.item() == pytest.approx(plain.item(), abs=1e-12)
    clipped, _ = distill_loss(zs, zt, tokens, mask, old_logp=logp_y - 5.0, cfg=cfg)
    assert clipped.item() == pytest.approx(2.0 * plain.item(), abs=1e-12)  # weight e^5 clipped to 2


def test_sampled_support_needs_the_reverse_kl() -> None:
    with pytest.raises(ValueError, match="reverse KL only"):
        distill_loss(logits(0), logits(1), torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5),
                     cfg=DistillConfig(beta=0.5, support="sampled"))  # fmt: skip


def test_sampled_token_gradient_sign() -> None:
    z = torch.zeros(1, 1, 3, requires_grad=True)
    teacher_low = torch.tensor([[[-3.0, 0.0, 0.0]]])  # q(y=0) < p(y=0)
    loss, _ = distill_loss(z, teacher_low, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                           cfg=DistillConfig(beta=1.0, support="sampled"))  # fmt: skip
    loss.backward()
    assert z.grad is not None and z.grad[0, 0, 0] > 0  # a descent step lowers the token's logit


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_ema_teacher_formula_and_isolation() -> None:
    student = Tiny()
    frozen = EmaTeacher(student, 0.0)
    copy = EmaTeacher(student, 1.0)
    ema = EmaTeacher(student, 0.25)
    before = [p.clone() for p in ema.model.parameters()]
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    x = torch.tensor([[1, 2, 3]])
    loss, _ = distill_loss(
        student(x), ema.model(x), x, torch.ones(1, 3), cfg=DistillConfig(beta=0.5, support="full")
    )
    (loss + student(x).square().mean()).backward()
    opt.step()
    for t in (frozen, copy, ema):
        t.step(student)
    assert all(p.grad is None for p in ema.model.parameters())
    for b, t0, t1, te, s in zip(before, frozen.model.parameters(), copy.model.parameters(), ema.model.parameters(),
                                student.parameters(), strict=True):  # fmt: skip
        torch.testing.assert_close(t0, b, atol=0, rtol=0)
        torch.testing.assert_close(t1, s.detach(), atol=0, rtol=0)
        torch.testing.assert_close(te, 0.75 * b + 0.25 * s.detach(), atol=1e-12, rtol=0)
    assert ema.updates == 1


def test_trust_region_mixing() -> None:
    zr, zs = logits(10), logits(11)
    torch.testing.assert_close(trust_region_logits(zr, zs, 0.0), zr, atol=0, rtol=0)
    torch.testing.assert_close(trust_region_logits(zr, zs, 1.0), zs, atol=0, rtol=0)
    a = 0.3
    mixed = torch.softmax(trust_region_logits(zr, zs, a), -1)
    geo = torch.softmax(zr, -1) ** (1 - a) * torch.softmax(zs, -1) ** a
    torch.testing.assert_close(mixed, geo / geo.sum(-1, keepdim=True), atol=1e-12, rtol=0)


def test_opsa_selects_the_lowest_logprobs_across_the_batch_and_scales_by_entropy() -> None:
    logp = torch.tensor([[-0.1, -3.0, -0.2, -5.0, -0.3], [-4.0, -0.1, -0.2, -0.3, -9.0]])
    ent = torch.tensor([[0.5, 2.0, 0.1, 1.0, 0.3], [3.0, 0.2, 0.2, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # the -9.0 token is padding
    adv, sel, metrics = opsa_advantages(logp, ent, mask, fraction=0.4)
    assert metrics == {"selected": 3.0, "valid": 9.0}
    assert sel.nonzero().tolist() == [[0, 1], [0, 3], [1, 0]]  # -5, -4, -3 across both samples
    assert adv[1, 0].item() == pytest.approx(-1.0) and adv[0, 3].item() == pytest.approx(-0.5)
    assert adv[0, 1].item() == pytest.approx(-0.5 - 0.5 * (2.0 - 1.0) / 2.0)
    assert torch.all(adv[sel] <= -0.5) and torch.all(adv[sel] >= -1.0) and torch.all(adv[~sel] == 0)
    equal, _, _ = opsa_advantages(logp, torch.ones_like(ent), mask, fraction=0.4)
    assert torch.all(equal[sel] == -1.0)
    fixed, _, _ = opsa_advantages(logp, ent, mask, fraction=0.4, fixed=-0.5)
    assert torch.all(fixed[sel] == -0.5)
    _, s1, _ = opsa_advantages(logp, ent, mask, fraction=0.0)
    assert int(s1.sum()) == 1  # at least one token
    empty, s0, m0 = opsa_advantages(logp, ent, torch.zeros_like(mask))
    assert int(s0.sum()) == 0 and torch.all(empty == 0) and m0["valid"] == 0
    with pytest.raises(ValueError, match="shape mismatch"):
        opsa_advantages(logp, ent[:, :3], mask)


def test_opsa_loss_pushes_down_only_selected_tokens_with_mean_over_the_selection() -> None:
    z = logits(12, (1, 4, 6)).requires_grad_(True)
    tokens = torch.tensor([[0, 1, 2, 3]])
    logp = torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1)
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    adv, sel, _ = opsa_advantages(logp, ent, torch.ones(1, 4), fraction=0.5)
    loss = opsa_loss(logp, adv, sel)
    assert loss.item() == pytest.approx(-(adv * logp.detach())[sel].sum().item() / 2)
    loss.backward()
    assert z.grad is not None
    for t in range(4):
        if sel[0, t]:
            assert z.grad[0, t, tokens[0, t]] > 0  # descent lowers the selected token's log-prob
        else:
            assert z.grad[0, t].abs().sum() == 0
