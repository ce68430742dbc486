"""The learning modules on an NVIDIA GPU, against their references: one command, one table.

    python scripts/gpu_check.py                 # on a machine with CUDA (what gpu-check.sh runs)
    python scripts/gpu_check.py --device cpu    # the same rows on the CPU (a dry run of the script)

Each row runs a module on the device and compares it with its dense reference computed in float64
on the CPU from the same inputs and weights (rounded to the row's dtype first, so a row measures
the module's arithmetic, not the rounding of its inputs): FlexAttention (compiled on CUDA) in float32 and bfloat16, document-routed sparse
attention (the MSA layer: memory bank, router, attention, gradients), and the distillation loss
with its gradients. It exits 1 if any row is outside its tolerance.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.learning.distillation import DistillConfig, distill_loss
from agents.learning.sparse_attention import (
    DocRoutedSparseAttention,
    doc_sparse_attention,
    flex_doc_sparse_attention,
)

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # max |error| relative to max |reference|
Row = tuple[str, float, float]


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return x rounded to dtype, in float64 on the CPU (the reference's copy of the row's input)."""
    return x.to(dtype).double().cpu()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Return max |got - want| over max |want| (both moved to float64 on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def flex_rows(device: str) -> list[Row]:
    """FlexAttention's block-sparse document routing vs the dense masked reference."""
    rows = []
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, length, m = 2, 8, 2, 64, 2048, 128
    docs = torch.arange(length - m) // 256  # 7 documents of 256 tokens, then the local context
    doc_of_key = torch.cat([docs, torch.full((m,), -1)]).expand(b, -1).contiguous()
    selected = torch.tensor([[0, 3, 5], [1, 2, 6]])
    q = torch.randn(b, hq, m, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    for ssmax in (None, 0.5):
        for dtype in (torch.float32, torch.bfloat16):
            rq, rk, rv = (rounded(t, dtype) for t in (q, k, v))
            want = doc_sparse_attention(rq, rk, rv, doc_of_key, selected, ssmax_scale=ssmax)
            dq, dk, dv = (t.to(device=device, dtype=dtype) for t in (q, k, v))
            got = flex_doc_sparse_attention(
                dq, dk, dv, doc_of_key.to(device), selected.to(device), ssmax_scale=ssmax,
                compile=device == "cuda",
            )  # fmt: skip
            name = f"flex {'compiled' if device == 'cuda' else 'eager'} {str(dtype)[6:]} ssmax={ssmax}"
            rows.append((name, rel_error(got, want), TOLERANCE[dtype]))
    return rows


def msa_rows(device: str) -> list[Row]:
    """The MSA layer (bank, router, attention) and its gradients on the device vs float64 on the CPU."""
    rows = []
    lens = [300, 257, 64, 511, 128, 90]
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        mod = DocRoutedSparseAttention(256, 8, 2, 32, top_k=3, pool=64, ssmax=True).to(dtype=dtype)
        ref = DocRoutedSparseAttention(256, 8, 2, 32, top_k=3, pool=64, ssmax=True).double()
        ref.load_state_dict({k: v.double() for k, v in mod.state_dict().items()})
        mod = mod.to(device)
        g = torch.Generator().manual_seed(1)
        docs, queries = torch.randn(sum(lens), 256, generator=g), torch.randn(2, 16, 256, generator=g)
        want_bank = ref.encode_docs(rounded(docs, dtype), lens)
        idx, _ = ref.route(rounded(queries, dtype), want_bank)
        want, _ = ref(rounded(queries, dtype), want_bank, doc_idx=idx)
        want.square().mean().backward()
        bank = mod.encode_docs(docs.to(device, dtype), lens)
        got_idx, scores = mod.route(queries.to(device, dtype), bank)
        got, _ = mod(queries.to(device, dtype), bank, doc_idx=idx.to(device))  # same documents
        got.float().square().mean().backward()
        name = str(dtype)[6:]
        rows.append((f"msa {name} output", rel_error(got, want), TOLERANCE[dtype]))
        assert mod.q_proj.weight.grad is not None and ref.q_proj.weight.grad is not None
        grad = rel_error(mod.q_proj.weight.grad, ref.q_proj.weight.grad)
        rows.append((f"msa {name} q_proj gradient", grad, 4 * TOLERANCE[dtype]))
        agree = float((got_idx.cpu() == idx).float().mean())
        rows.append(
            (f"msa {name} router picks (1 - agreement)", 1 - agree, 0.34 if dtype == torch.bfloat16 else 0.0)
        )
        rows.append(
            (f"msa {name} scores on device", float(scores.device.type != torch.device(device).type), 0.0)
        )
    return rows


def distill_rows(device: str) -> list[Row]:
    """The distillation loss and its gradient on each support, on the device vs float64 on the CPU."""
    rows = []
    g = torch.Generator().manual_seed(2)
    b, t, vocab = 4, 64, 32_000
    student = torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    teacher = torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    for support, beta in (("full", 0.5), ("topk", 0.5), ("sampled", 1.0)):
        cfg = DistillConfig(beta=beta, support=support, topk=64)  # type: ignore[arg-type]
        for dtype in (torch.float32, torch.bfloat16):
            ref_in = rounded(student, dtype).requires_grad_(True)
            want, _ = distill_loss(ref_in, rounded(teacher, dtype), tokens, mask, cfg=cfg)
            want.backward()  # type: ignore[no-untyped-call]
            got_in = student.to(device, dtype).requires_grad_(True)
            got, _ = distill_loss(
                got_in, teacher.to(device, dtype), tokens.to(device), mask.to(device), cfg=cfg
            )
            got.backward()  # type: ignore[no-untyped-call]
            assert got_in.grad is not None and ref_in.grad is not None
            name = f"distill {support} {str(dtype)[6:]}"
            rows.append((f"{name} loss", rel_error(got, want), TOLERANCE[dtype]))
            rows.append((f"{name} gradient", rel_error(got_in.grad, ref_in.grad), 4 * TOLERANCE[dtype]))
    return rows


def main() -> int:
    """Print the table; return 1 if any row is outside its tolerance."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = ap.parse_args().device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a dry run")
        return 1
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {where}\n")
    print("| check | error | tolerance | |\n|---|---|---|---|")
    failed = 0
    checks: list[Callable[[str], list[Row]]] = [flex_rows, msa_rows, distill_rows]
    for check in checks:
        for name, err, tol in check(device):
            ok = err <= tol
            failed += not ok
            print(f"| {name} | {err:.2e} | {tol:.0e} | {'ok' if ok else 'FAIL'} |")
    print(f"\n{'all rows within tolerance' if not failed else f'{failed} rows outside tolerance'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
