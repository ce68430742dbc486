"""Raw-token document routing (BlockSearch-style): queries see only their selected documents' tokens.

This is the dense masked reference that runs anywhere (CPU tests, the oracle for a fused kernel).
Key j is visible to query row i when its document is selected, or when it is a local token
(doc id -1) at or before the query's own position (the queries are the last M local tokens).
"""

from __future__ import annotations

import torch

from agents.learning.sparse_attention.ssmax import ssmax_softmax


def document_mask(
    doc_of_key: torch.Tensor, selected_docs: torch.Tensor, m: int, causal: bool = True
) -> torch.Tensor:
    """Return the [B, H or 1, M, L] boolean visibility mask of M query rows over L keys."""
    _b, length = doc_of_key.shape
    sel = selected_docs if selected_docs.dim() == 3 else selected_docs[:, None, :]  # [B, H, k]
    in_doc = (doc_of_key[:, None, :, None] == sel[:, :, None, :]).any(-1)  # [B, H, L]
    in_doc = in_doc & (doc_of_key[:, None, :] >= 0)
    local = doc_of_key < 0  # [B, L]
    q_pos = torch.arange(length - m, length, device=doc_of_key.device)  # absolute query positions
    k_pos = torch.arange(length, device=doc_of_key.device)
    seen = (
        k_pos[None, :] <= q_pos[:, None]
        if causal
        else torch.ones(m, length, dtype=torch.bool, device=doc_of_key.device)
    )
    local_ok = local[:, None, None, :] & seen[None, None, :, :]  # [B, 1, M, L]
    return in_doc[:, :, None, :] | local_ok


def doc_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_of_key: torch.Tensor,
    selected_docs: torch.Tensor,
    causal: bool = True,
    ssmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q [B,Hq,M,D] over k/v [B,Hkv,L,D] restricted to the selected documents."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    mask = document_mask(doc_of_key, selected_docs, q.shape[2], causal)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if ssmax_scale is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        weights = ssmax_softmax(scores, ssmax_scale)
    return torch.nan_to_num(weights) @ v
