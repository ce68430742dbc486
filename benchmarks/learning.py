"""Learning modules side by side: sparse attention vs dense SDPA, and a distillation step vs cross-entropy.

    python benchmarks/learning.py                      # CPU, small shapes
    python benchmarks/learning.py --device cuda        # the reference's §6.3 shapes (8K-128K, bf16)

(1) For each memory length L (documents of G tokens), a query of M tokens either attends densely
to all L + M tokens (`scaled_dot_product_attention`, causal over the query) or goes through the
MSA layer (routing over pooled chunks, then attention over the top-k documents' pooled KV).
Reported: forward latency (median), speed-up, achieved TFLOP/s effective (work actually done)
and dense-equivalent (dense work / sparse time), and peak memory on CUDA.
(2) One forward+backward of `distill_loss` (full vocabulary, JSD 0.5) vs plain cross-entropy on
the same [B, T, V] logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from agents.learning.distillation import DistillConfig, distill_loss
from agents.learning.sparse_attention import DocRoutedSparseAttention


def timed(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Return the median seconds of fn() after a warm-up."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak(device: str) -> str:
    if device != "cuda":
        return "n/a"
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"


def sparse_vs_dense(args: argparse.Namespace) -> None:
    dev, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    hq, hkv, d, g, m, k, pool = (
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.doc_len,
        args.query_len,
        args.top_k,
        64,
    )
    model = DocRoutedSparseAttention(hq * d, hq, hkv, d, top_k=k, pool=pool).to(dev, dtype)
    print(f"sparse attention: B=1 Hq={hq} Hkv={hkv} D={d} G={g} M={m} k={k} P={pool} {dtype} on {dev}")
    print(
        "| L | dense SDPA ms | sparse ms | speed-up | sparse TFLOP/s eff. | dense-equiv. TFLOP/s | peak mem |"
    )
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        n_docs = length // g
        docs = torch.randn(n_docs * g, hq * d, device=dev, dtype=dtype)
        hq_in = torch.randn(1, m, hq * d, device=dev, dtype=dtype)
        with torch.no_grad():
            bank = model.encode_docs(docs, [g] * n_docs)
            q = torch.randn(1, hq, m, d, device=dev, dtype=dtype)
            kk = torch.randn(1, hq, length + m, d, device=dev, dtype=dtype)
            vv = torch.randn(1, hq, length + m, d, device=dev, dtype=dtype)
            mask = torch.ones(m, length + m, dtype=torch.bool, device=dev)
            mask[:, length:] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            dense = timed(
                partial(F.scaled_dot_product_attention, q, kk, vv, attn_mask=mask), dev, args.repeats
            )
            sparse = timed(partial(model, hq_in, bank), dev, args.repeats)
        chunks = bank.k_bar.shape[0]
        selected = min(k, n_docs) * -(-g // pool)
        dense_flops = 4 * hq * m * (length + m) * d
        sparse_flops = 2 * hq * m * chunks * d + 4 * hq * m * (selected + m) * d  # routing + attention
        print(
            f"| {length:,} | {dense * 1e3:.2f} | {sparse * 1e3:.2f} | {dense / sparse:.2f}x | "
            f"{sparse_flops / sparse / 1e12:.4f} | {dense_flops / sparse / 1e12:.4f} | {peak(dev)} |"
        )


def distill_vs_ce(args: argparse.Namespace) -> None:
    dev = args.device
    b, t, v = (4, 512, 32_000) if dev == "cuda" else (2, 128, 8_000)
    zs = torch.randn(b, t, v, device=dev, requires_grad=True)
    zt = torch.randn(b, t, v, device=dev)
    tokens = torch.randint(0, v, (b, t), device=dev)
    mask = torch.ones(b, t, device=dev)
    cfg = DistillConfig(beta=0.5, support="full")

    def ce() -> None:
        F.cross_entropy(zs.view(-1, v), tokens.view(-1)).backward()

    def distill() -> None:
        distill_loss(zs, zt, tokens, mask, cfg=cfg)[0].backward()

    a, c = timed(distill, dev, args.repeats), timed(ce, dev, args.repeats)
    topk = timed(
        lambda: distill_loss(zs, zt, tokens, mask, cfg=DistillConfig(beta=0.5, topk=100))[0].backward(),
        dev,
        args.repeats,
    )
    print(f"\ndistillation step on [{b}, {t}, {v}] logits, forward+backward, {dev}:")
    print(f"| loss | ms | vs cross-entropy |\n|---|---|---|\n| cross-entropy | {c * 1e3:.2f} | 1.00x |")
    print(
        f"| JSD 0.5, full vocabulary | {a * 1e3:.2f} | {a / c:.2f}x |\n| JSD 0.5, top-100 + tail | {topk * 1e3:.2f} | {topk / c:.2f}x |"
    )


def raw_routing_flex(args: argparse.Namespace) -> None:
    """Raw-token routing: FlexAttention block mask (compiled) vs dense SDPA with the same boolean mask."""
    from agents.learning.sparse_attention.flex import flex_doc_sparse_attention
    from agents.learning.sparse_attention.raw import document_mask

    dev, dtype = args.device, torch.bfloat16
    hq, hkv, d, g, m, k = args.heads, args.kv_heads, args.head_dim, args.doc_len, args.query_len, args.top_k
    print(
        f"\nraw-token routing, FlexAttention block mask vs masked dense SDPA: Hq={hq} Hkv={hkv} D={d} G={g} M={m} k={k}"
    )
    print("| L | masked SDPA ms | flex ms | speed-up |\n|---|---|---|---|")
    for length in args.lengths:
        n_docs = (length - m) // g
        doc_of_key = torch.cat(
            [torch.arange(n_docs).repeat_interleave(g), torch.full((length - n_docs * g,), -1)]
        )
        doc_of_key = doc_of_key[None].to(dev)
        selected = torch.randperm(n_docs)[:k].sort().values[None].to(dev)
        q = torch.randn(1, hq, m, d, device=dev, dtype=dtype)
        kk = torch.randn(1, hkv, length, d, device=dev, dtype=dtype)
        vv = torch.randn(1, hkv, length, d, device=dev, dtype=dtype)
        mask = document_mask(doc_of_key, selected, m)
        with torch.no_grad():
            dense = timed(
                partial(F.scaled_dot_product_attention, q, kk, vv, attn_mask=mask, enable_gqa=True),
                dev,
                args.repeats,
            )
            flex = timed(
                partial(flex_doc_sparse_attention, q, kk, vv, doc_of_key, selected), dev, args.repeats
            )
        print(f"| {length:,} | {dense * 1e3:.2f} | {flex * 1e3:.2f} | {dense / flex:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.repeats = args.repeats or (20 if gpu else 5)
    args.lengths = [8192, 16384, 32768, 65536, 131072] if gpu else [2048, 4096, 8192, 16384]
    args.heads, args.kv_heads, args.head_dim = (32, 8, 128) if gpu else (8, 2, 64)
    args.doc_len, args.query_len, args.top_k = (2048, 128, 16) if gpu else (512, 64, 4)
    torch.manual_seed(0)
    sparse_vs_dense(args)
    if gpu:  # eager FlexAttention on the CPU is an unfused reference, not worth timing
        raw_routing_flex(args)
    distill_vs_ce(args)


if __name__ == "__main__":
    main()
