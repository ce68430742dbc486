"""Raw-token document routing on FlexAttention: a block mask skips every unselected document.

Same contract and result as `raw.doc_sparse_attention` (its dense masked reference), but the
mask is a `mask_mod` that `create_block_mask` turns into a block-sparse layout, so a GPU kernel
only visits the blocks of selected documents and of the causal local context. On CUDA the
kernel is compiled (`torch.compile(flex_attention)`); elsewhere it runs eagerly, which is how
the CPU tests check it against the reference. Deviation from the reference card: SSMax's
per-row visible-key count comes from the document lengths and the local prefix, computed once,
and enters as a `score_mod` scale instead of counting finite scores.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


@cache
def _compiled() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def flex_doc_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_of_key: torch.Tensor,
    selected_docs: torch.Tensor,
    causal: bool = True,
    ssmax_scale: float | None = None,
    block_size: int = 128,
    compile: bool | None = None,
) -> torch.Tensor:
    """Attention of q [B,Hq,M,D] over k/v [B,Hkv,L,D] restricted to the selected documents."""
    b, hq, m, _ = q.shape
    length = k.shape[2]
    n_docs = int(doc_of_key.max().clamp_min(0)) + 1
    sel = selected_docs if selected_docs.dim() == 3 else selected_docs[:, None, :].expand(b, hq, -1)
    table = torch.zeros(b, hq, n_docs + 1, dtype=torch.bool, device=q.device)  # last slot: "no document"
    table.scatter_(2, sel.clamp(0, n_docs - 1).to(q.device), sel.to(q.device) >= 0)
    docs = doc_of_key.to(q.device)
    slot = torch.where(docs >= 0, docs, torch.full_like(docs, n_docs))
    offset = length - m  # the queries are the last M positions

    def mask_mod(bi: Any, hi: Any, qi: Any, ki: Any) -> Any:
        d = docs[bi, ki]
        local = (d < 0) & ((ki <= qi + offset) if causal else (ki >= 0))
        return table[bi, hi, slot[bi, ki]] | local

    score_mod = None
    if ssmax_scale is not None:
        counts = torch.zeros(b, n_docs + 1, device=q.device, dtype=torch.long)
        counts.scatter_add_(1, slot, torch.ones_like(slot))
        in_docs = (table[:, :, :n_docs].long() * counts[:, None, :n_docs]).sum(-1)  # [B, H]
        local_before = torch.cumsum((docs < 0).long(), dim=1)  # [B, L]
        q_pos = torch.arange(offset, length, device=q.device)
        local_seen = local_before[:, q_pos] if causal else local_before[:, -1:].expand(b, m)
        n = (in_docs[:, :, None] + local_seen[:, None, :]).to(q.dtype)  # [B, H, M]
        scale = torch.where(n > 1, ssmax_scale * torch.log(n.clamp_min(1.0)), torch.ones_like(n))

        def score_mod(score: Any, bi: Any, hi: Any, qi: Any, ki: Any) -> Any:
            return score * scale[bi, hi, qi]

    block = create_block_mask(mask_mod, b, hq, m, length, device=q.device, BLOCK_SIZE=block_size)
    use_compiled = q.is_cuda if compile is None else compile
    attend = _compiled() if use_compiled else flex_attention
    out = attend(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=hq != k.shape[1])
    # A row that sees nothing is 0 in the reference (nan_to_num of an all -inf softmax).
    return torch.nan_to_num(out)
