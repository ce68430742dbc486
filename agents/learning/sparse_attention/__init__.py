"""Document-routed sparse attention: MSA-style pooled memory, raw-token routing, SSMax."""

from agents.learning.sparse_attention.flex import flex_doc_sparse_attention
from agents.learning.sparse_attention.msa import (
    DocRoutedSparseAttention,
    MemoryBank,
    chunk_mean,
    rope,
    routing_aux_loss,
)
from agents.learning.sparse_attention.raw import doc_sparse_attention, document_mask
from agents.learning.sparse_attention.ssmax import ssmax_softmax

__all__ = [
    "DocRoutedSparseAttention",
    "MemoryBank",
    "chunk_mean",
    "doc_sparse_attention",
    "document_mask",
    "flex_doc_sparse_attention",
    "rope",
    "routing_aux_loss",
    "ssmax_softmax",
]
