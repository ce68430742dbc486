"""The learning modules build every tensor on their inputs' device, so a GPU run cannot mix devices.

CI has no GPU, so two checks stand in for one: the memory bank and the router run on the `meta`
device (a tensor built on the CPU inside them shows up as a CPU tensor, or an error), and every
tensor factory the modules call while they run (forward and backward) must name a device.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from agents.learning.distillation import (
    DistillConfig,
    EmaTeacher,
    distill_loss,
    opsa_advantages,
    opsa_loss,
    trust_region_logits,
)
from agents.learning.sparse_attention import (
    DocRoutedSparseAttention,
    chunk_mean,
    doc_sparse_attention,
    flex_doc_sparse_attention,
    routing_aux_loss,
)

LENS = [5, 7, 3, 6]
MODULES = Path(__file__).resolve().parents[2] / "agents" / "learning"
FACTORIES = {
    torch.tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.randn,
    torch.rand, torch.randint, torch.eye, torch.linspace,
}  # fmt: skip


Case = Callable[["FactoryAudit"], None]


class FactoryAudit(TorchFunctionMode):
    """Record each tensor factory called from the learning modules without a device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back  # type: ignore[assignment]
            if frame is not None and Path(frame.f_code.co_filename).is_relative_to(MODULES):
                self.found.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


def test_the_memory_bank_and_the_router_stay_on_the_inputs_device() -> None:
    mod = DocRoutedSparseAttention(16, 4, 2, 8, top_k=2, pool=3).to("meta")
    docs, queries = torch.empty(sum(LENS), 16, device="meta"), torch.empty(2, 4, 16, device="meta")
    pooled, chunk_doc, doc_ptr = chunk_mean(docs, LENS, 3)
    assert {t.device.type for t in (pooled, chunk_doc, doc_ptr)} == {"meta"}
    bank = mod.encode_docs(docs, LENS)
    assert {t.device.type for t in bank} == {"meta"}
    selected, scores = mod.route(queries, bank)
    assert selected.device.type == "meta" and scores.shape == (2, len(LENS))


def _msa(ssmax: bool) -> Case:
    def run(audit: FactoryAudit) -> None:
        torch.manual_seed(0)
        mod = DocRoutedSparseAttention(16, 4, 2, 8, top_k=2, pool=3, ssmax=ssmax)  # built, then moved
        docs, queries = torch.randn(sum(LENS), 16), torch.randn(2, 4, 16)
        fixed_idx = torch.tensor([[0, 2], [1, 3]])
        positives = torch.zeros(2, len(LENS), dtype=torch.bool)
        positives[:, 1] = True
        with audit:
            bank = mod.encode_docs(docs, LENS)
            out, aux = mod(queries, bank)
            fixed, _ = mod(queries, bank, doc_idx=fixed_idx)
            loss = out.sum() + fixed.sum() + routing_aux_loss(aux["doc_scores"], positives)
            loss.backward()

    return run


def _raw(causal: bool, flex: bool) -> Case:
    def run(audit: FactoryAudit) -> None:
        q = torch.randn(1, 2, 3, 8, requires_grad=not flex)  # FlexAttention has no CPU backward
        k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        doc_of_key = torch.tensor([[0, 0, 1, 1, 1, 2, 2, -1, -1, -1]])
        selected = torch.tensor([[0, 2]])
        attend = flex_doc_sparse_attention if flex else doc_sparse_attention
        with audit:
            out = attend(q, k, v, doc_of_key, selected, causal=causal, ssmax_scale=0.5).sum()
            if out.requires_grad:
                out.backward()  # type: ignore[no-untyped-call]

    return run


def _distill(support: str) -> Case:
    def run(audit: FactoryAudit) -> None:
        student = torch.randn(2, 5, 11, requires_grad=True)
        teacher = torch.randn(2, 5, 11)
        tokens = torch.randint(0, 11, (2, 5))
        mask = torch.ones(2, 5, dtype=torch.bool)
        cfg = DistillConfig(beta=1.0 if support == "sampled" else 0.5, support=support, topk=4)  # type: ignore[arg-type]
        with audit:
            loss, _ = distill_loss(student, teacher, tokens, mask, cfg=cfg)
            logp_all = torch.log_softmax(student, -1)
            logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
            adv, sel, _ = opsa_advantages(logp, -(logp_all.exp() * logp_all).sum(-1), mask)
            mixed = trust_region_logits(teacher, student, 0.3)
            (loss + opsa_loss(logp, adv, sel) + mixed.mean()).backward()  # type: ignore[no-untyped-call]

    return run


def _ema(audit: FactoryAudit) -> None:
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with audit:
        teacher = EmaTeacher(net, 0.1)
        teacher.step(net)
        teacher.model(x).sum()


@pytest.mark.parametrize(
    "name, run",
    [
        ("msa", _msa(False)),
        ("msa ssmax", _msa(True)),
        *[(f"raw causal={c} flex={f}", _raw(c, f)) for c in (True, False) for f in (False, True)],
        *[(f"distill {s}", _distill(s)) for s in ("full", "topk", "sampled")],
        ("ema teacher", _ema),
    ],
)
def test_every_tensor_the_modules_build_names_a_device(name: str, run: Case) -> None:
    audit = FactoryAudit()
    run(audit)
    assert audit.calls > 0  # the audit saw the modules run
    assert not audit.found, f"{name}: tensors built without a device (CPU on any machine): {audit.found}"


def test_the_gpu_check_runs_its_rows_on_the_cpu() -> None:
    """`scripts/gpu-check.sh`'s table, dry-run on the CPU, so the script keeps working between GPU runs."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu"], cwd=root, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "check" not in line]
    assert len(rows) == 24 and all(line.endswith("| ok |") for line in rows)
    assert any(line.startswith("| flex eager bfloat16") for line in rows)
