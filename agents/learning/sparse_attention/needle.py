"""Needle-in-documents recall of the routed memory: can top-k routing find the one relevant document?

A needle document is planted among random ones (each document's tokens share a topic vector scaled
by `topic`); the query is a few of the needle's tokens plus noise. With
the query and key routers tied, routing should pick the needle; pooling coarser chunks dilutes
its signal and a smaller k leaves less room for error. Used by the `sparse_eval` GPU job and by
`examples/needle`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from agents.learning.sparse_attention.msa import DocRoutedSparseAttention


def needle_recall(
    params: dict[str, Any], device: str = "cpu", on_trial: Callable[[int], object] | None = None
) -> dict[str, Any]:
    """Plant a needle document, query with its tokens plus noise, and measure top-k routing recall."""
    g, n_docs, pool = int(params["doc_len"]), int(params["docs"]), int(params["pool"])
    heads, head_dim, m = 4, 16, 8
    gen = torch.Generator().manual_seed(int(params["seed"]))
    torch.manual_seed(int(params["seed"]))
    model = DocRoutedSparseAttention(heads * head_dim, heads, heads, head_dim, top_k=int(params["top_k"]),
                                     pool=pool, ssmax=bool(params["ssmax"])).to(device)  # fmt: skip
    with torch.no_grad():
        model.router_q.weight.copy_(model.router_k.weight)  # query and key routers agree on a token
    hits, seconds = 0, 0.0
    for trial in range(int(params["trials"])):
        docs = torch.randn(n_docs * g, heads * head_dim, generator=gen)
        topics = torch.randn(n_docs, heads * head_dim, generator=gen)
        docs = (docs + float(params.get("topic", 0.0)) * topics.repeat_interleave(g, dim=0)).to(device)
        needle = int(torch.randint(n_docs, (1,), generator=gen))
        picks = needle * g + torch.randint(g, (m,), generator=gen)
        noise = float(params["noise"]) * torch.randn(1, m, heads * head_dim, generator=gen).to(device)
        query = docs[picks.to(device)][None] + noise
        t = time.perf_counter()
        with torch.no_grad():
            bank = model.encode_docs(docs, [g] * n_docs)
            _, aux = model(query, bank)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t
        hits += int(needle in aux["doc_idx"][0].tolist())
        if on_trial is not None:
            on_trial(trial + 1)
    chunks_per_doc = -(-g // pool)
    return {
        "recall": hits / int(params["trials"]),
        "kv_tokens": min(int(params["top_k"]), n_docs) * chunks_per_doc + m,
        "context_tokens": n_docs * g,
        "ms_per_query": 1000 * seconds / int(params["trials"]),
    }
