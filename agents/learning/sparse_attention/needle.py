"""Needle-in-documents recall of the routed memory: can top-k routing find the one relevant document?

A needle document is planted among random ones (each document's tokens share a topic vector scaled
by `topic`, drawn from a `topic_rank`-dimensional subspace when that is set); the query is a few
of the needle's tokens plus noise. With the query and key routers tied, routing should pick the
needle; pooling coarser chunks dilutes its signal and a smaller k leaves less room for error.
`train_router` instead learns the routers with the routing loss (MSA Eq. 5) from a fresh layer.
Used by the `sparse_eval` and `sparse_train` GPU jobs and by `examples/needle`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from agents.learning.sparse_attention.msa import DocRoutedSparseAttention, routing_aux_loss

HEADS, HEAD_DIM, QUERY_TOKENS = 4, 16, 8


def layer(params: dict[str, Any], device: str, tied: bool) -> DocRoutedSparseAttention:
    """Return the task's attention layer; `tied` makes the query router a copy of the key router."""
    torch.manual_seed(int(params["seed"]))
    model = DocRoutedSparseAttention(HEADS * HEAD_DIM, HEADS, HEADS, HEAD_DIM, top_k=int(params["top_k"]),
                                     pool=int(params["pool"]), ssmax=bool(params["ssmax"])).to(device)  # fmt: skip
    if tied:
        with torch.no_grad():
            model.router_q.weight.copy_(model.router_k.weight)  # query and key routers agree on a token
    return model


def episode(
    params: dict[str, Any], gen: torch.Generator, device: str, n_docs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return (documents [N·G, d], a query [1, M, d] of the needle's tokens plus noise, the needle's id)."""
    g, n = int(params["doc_len"]), n_docs or int(params["docs"])
    docs = torch.randn(n * g, HEADS * HEAD_DIM, generator=gen)
    rank = int(params.get("topic_rank") or 0)
    if rank:  # topics share a low-rank subspace (fixed by `basis_seed`): a router can learn to look there
        basis = torch.randn(
            rank, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(int(params.get("basis_seed", 0)))
        )
        topics = torch.randn(n, rank, generator=gen) @ basis
    else:
        topics = torch.randn(n, HEADS * HEAD_DIM, generator=gen)
    docs = (docs + float(params.get("topic", 0.0)) * topics.repeat_interleave(g, dim=0)).to(device)
    needle = int(torch.randint(n, (1,), generator=gen))
    picks = needle * g + torch.randint(g, (QUERY_TOKENS,), generator=gen)
    noise = float(params["noise"]) * torch.randn(1, QUERY_TOKENS, HEADS * HEAD_DIM, generator=gen).to(device)
    return docs, docs[picks.to(device)][None] + noise, needle


def recall(
    model: DocRoutedSparseAttention,
    params: dict[str, Any],
    seed: int,
    device: str = "cpu",
    on_trial: Callable[[int], object] | None = None,
) -> tuple[float, float]:
    """Return (recall, ms per query) of top-k routing over `trials` episodes drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    g, n_docs = int(params["doc_len"]), int(params["docs"])
    hits, seconds = 0, 0.0
    for trial in range(int(params["trials"])):
        docs, query, needle = episode(params, gen, device)
        t = time.perf_counter()
        with torch.no_grad():
            bank = model.encode_docs(docs, [g] * n_docs)
            _, aux = model(query, bank)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t
        hits += int(needle in aux["doc_idx"][0].tolist())
        if on_trial is not None:
            on_trial(trial + 1)
    return hits / int(params["trials"]), 1000 * seconds / int(params["trials"])


def needle_recall(
    params: dict[str, Any], device: str = "cpu", on_trial: Callable[[int], object] | None = None
) -> dict[str, Any]:
    """Plant a needle document, query with its tokens plus noise, and measure top-k routing recall."""
    g, n_docs, pool = int(params["doc_len"]), int(params["docs"]), int(params["pool"])
    model = layer(params, device, tied=True)
    found, ms = recall(model, params, int(params["seed"]), device, on_trial)
    return {
        "recall": found,
        "kv_tokens": min(int(params["top_k"]), n_docs) * -(-g // pool) + QUERY_TOKENS,
        "context_tokens": n_docs * g,
        "ms_per_query": ms,
    }


def train_router(
    params: dict[str, Any], device: str = "cpu", on_step: Callable[[int, float], object] | None = None
) -> dict[str, Any]:
    """Train an untied router with the routing loss on needle episodes; recall before and after.

    Training episodes come from `seed` (with `train_docs` documents each); recall is measured on
    `trials` episodes from `eval_seed`, documents the router never saw. Only the two routing
    projections learn (`router_q`, `router_k`): routing reads nothing else. `tied` starts the query
    router as a copy of the key router (the hand-made router `needle_recall` uses).
    """
    model = layer(params, device, tied=bool(params.get("tied", False)))
    eval_seed = int(params["eval_seed"])
    before, _ = recall(model, params, eval_seed, device)
    routers = [*model.router_q.parameters(), *model.router_k.parameters()]
    opt = torch.optim.Adam(routers, lr=float(params["lr"]))
    gen = torch.Generator().manual_seed(int(params["seed"]) + 1)
    n, g, tau = int(params["train_docs"]), int(params["doc_len"]), float(params["tau"])
    losses = []
    for step in range(int(params["steps"])):
        docs, query, needle = episode(params, gen, device, n_docs=n)
        bank = model.encode_docs(docs, [g] * n)
        _, scores = model.route(query, bank)
        positives = torch.zeros_like(scores, dtype=torch.bool)
        positives[0, needle] = True
        loss = routing_aux_loss(scores, positives, tau)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    after, ms = recall(model, params, eval_seed, device)
    return {
        "recall_before": before,
        "recall_after": after,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "ms_per_query": ms,
        "model": model,
    }
