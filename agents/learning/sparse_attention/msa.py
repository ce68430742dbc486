"""MSA-style memory sparse attention (Chen et al., arXiv 2603.23516, §3.2).

Documents are encoded independently with document-wise RoPE (positions restart at 0), their keys,
values and routing keys chunk-mean pooled (chunk size P, ragged last chunk). A query scores each
chunk by the cosine of its routing query with the chunk's routing key, mean over heads and max
over query tokens; a document's score is its best chunk; the top-k documents (ties: lowest id)
are shared by all heads and query tokens. The query then attends to [the selected documents'
pooled KV in document order ; its own KV], the prefix fully visible, causal within the query, with
query positions offset by k (global RoPE). Selection is a hard top-k: the router learns only from
`routing_aux_loss`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from agents.learning.sparse_attention.ssmax import ssmax_softmax


class MemoryBank(NamedTuple):
    k_bar: torch.Tensor  # [C, Hkv, D] pooled keys (after document-wise RoPE)
    v_bar: torch.Tensor  # [C, Hkv, D]
    kr_bar: torch.Tensor  # [C, Hkv, D] pooled routing keys (L2-normalised for cosine scores)
    chunk_doc: torch.Tensor  # [C] document of each chunk
    doc_ptr: torch.Tensor  # [N + 1] chunk offsets per document


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate x [..., T, H, D] by its positions [T] (pairs of the last dim, half-split layout)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def chunk_mean(
    x: torch.Tensor, doc_lens: list[int], pool: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool x [ΣG, ...] per document into chunks of `pool` tokens; return (pooled, chunk_doc, doc_ptr)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # accumulate in fp32 or better
    out, owners, ptr = [], [], [0]
    start = 0
    for doc, g in enumerate(doc_lens):
        part = x[start : start + g].to(acc)
        for c in range(0, g, pool):
            out.append(part[c : c + pool].mean(dim=0))
            owners.append(doc)
        ptr.append(ptr[-1] + math.ceil(g / pool))
        start += g
    pooled = torch.stack(out).to(x.dtype) if out else x.new_zeros((0, *x.shape[1:]))
    # On x's device: chunk_doc is a scatter index into scores that live there.
    return (
        pooled,
        torch.tensor(owners, dtype=torch.long, device=x.device),
        torch.tensor(ptr, dtype=torch.long, device=x.device),
    )


def routing_aux_loss(doc_scores: torch.Tensor, positives: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Supervised-contrastive routing loss (MSA Eq. 5) over doc_scores [B, N] and positives [B, N]."""
    logits = doc_scores / tau
    neg = logits.masked_fill(positives, float("-inf"))
    neg_lse = torch.logsumexp(neg, dim=-1, keepdim=True)  # [B, 1]
    per = -(logits - torch.logaddexp(logits, neg_lse))  # -log(e^s+ / (e^s+ + Σ e^s-))
    return per[positives].mean()


class DocRoutedSparseAttention(nn.Module):
    """One attention layer over a memory of independently encoded documents."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        top_k: int = 16,
        pool: int = 64,
        ssmax: bool = False,
        ssmax_init: float = 0.43,
    ) -> None:
        super().__init__()
        assert n_heads % n_kv_heads == 0
        self.hq, self.hkv, self.d = n_heads, n_kv_heads, head_dim
        self.top_k, self.pool = top_k, pool
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.router_q = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.router_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.ssmax_scale = nn.Parameter(torch.tensor(float(ssmax_init))) if ssmax else None

    def _heads(self, x: torch.Tensor, h: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], h, self.d)

    def encode_docs(self, hidden_docs: torch.Tensor, doc_lens: list[int]) -> MemoryBank:
        """Encode documents [ΣG, d] independently (document-wise RoPE) and pool them."""
        keys, start = [], 0
        for g in doc_lens:
            k = self._heads(self.k_proj(hidden_docs[start : start + g]), self.hkv)
            keys.append(rope(k, torch.arange(g, device=hidden_docs.device)))
            start += g
        k_all = torch.cat(keys) if keys else hidden_docs.new_zeros((0, self.hkv, self.d))
        v_all = self._heads(self.v_proj(hidden_docs), self.hkv)
        kr_all = F.normalize(self._heads(self.router_k(hidden_docs), self.hkv), dim=-1)
        k_bar, chunk_doc, doc_ptr = chunk_mean(k_all, doc_lens, self.pool)
        v_bar, _, _ = chunk_mean(v_all, doc_lens, self.pool)
        kr_bar, _, _ = chunk_mean(kr_all, doc_lens, self.pool)
        return MemoryBank(k_bar, v_bar, F.normalize(kr_bar, dim=-1), chunk_doc, doc_ptr)

    def route(self, hidden_q: torch.Tensor, bank: MemoryBank) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (selected doc ids [B, k] ascending, document scores [B, N])."""
        n_docs = bank.doc_ptr.numel() - 1
        b = hidden_q.shape[0]
        qr = F.normalize(self._heads(self.router_q(hidden_q), self.hq), dim=-1)  # [B, M, Hq, D]
        kr = bank.kr_bar.repeat_interleave(self.hq // self.hkv, dim=1)  # [C, Hq, D]
        chunk = torch.einsum("bmhd,chd->bmhc", qr, kr).mean(dim=2).amax(dim=1)  # [B, C]
        scores = chunk.new_full((b, n_docs), float("-inf"))
        scores = scores.scatter_reduce(
            1, bank.chunk_doc.expand(b, -1), chunk, reduce="amax", include_self=True
        )
        k = min(self.top_k, n_docs)
        order = torch.sort(-scores.detach(), dim=1, stable=True).indices  # ties: the lower id first
        return order[:, :k].sort(dim=1).values, scores

    def forward(
        self, hidden_q: torch.Tensor, bank: MemoryBank, doc_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Attend from the query [B, M, d] to its selected documents; return (out, aux)."""
        scores = hidden_q.new_empty(0)
        if doc_idx is None:
            doc_idx, scores = self.route(hidden_q, bank)
        b, m, _ = hidden_q.shape
        k_sel = doc_idx.shape[1]
        pos = torch.arange(k_sel, k_sel + m, device=hidden_q.device)  # global RoPE: queries start at k
        q = rope(self._heads(self.q_proj(hidden_q), self.hq), pos)
        kq = rope(self._heads(self.k_proj(hidden_q), self.hkv), pos)
        vq = self._heads(self.v_proj(hidden_q), self.hkv)
        outs = []
        ptr, device = bank.doc_ptr.tolist(), bank.k_bar.device  # one host copy of the offsets
        for i in range(b):
            chunks = torch.cat(
                [torch.arange(ptr[d], ptr[d + 1], device=device) for d in doc_idx[i].tolist()]
                or [torch.zeros(0, dtype=torch.long, device=device)]
            )
            keys = torch.cat([bank.k_bar[chunks], kq[i]])  # [S + M, Hkv, D]
            vals = torch.cat([bank.v_bar[chunks], vq[i]])
            outs.append(self._attend(q[i], keys, vals, prefix=chunks.numel()))
        out = torch.stack(outs).reshape(b, m, self.hq * self.d)
        return self.o_proj(out), {"doc_idx": doc_idx, "doc_scores": scores}

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
        m = q.shape[0]
        rep = self.hq // self.hkv
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, S+M, D]
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        q = q.transpose(0, 1)  # [Hq, M, D]
        visible = torch.ones(m, prefix + m, dtype=torch.bool, device=q.device)
        visible[:, prefix:] = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        if self.ssmax_scale is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        else:
            scores = (q @ k.transpose(-1, -2)) / self.d**0.5
            scores = scores.masked_fill(~visible, float("-inf"))
            n = visible.sum(-1, keepdim=True)
            out = ssmax_softmax(scores, self.ssmax_scale, n) @ v
        return out.transpose(0, 1)  # [M, Hq, D]
