"""Correctness of the sparse-attention module on CPU in float64."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from agents.learning.sparse_attention import (
    DocRoutedSparseAttention,
    chunk_mean,
    doc_sparse_attention,
    rope,
    routing_aux_loss,
    ssmax_softmax,
)

LENS = [5, 7, 3, 6]


@pytest.fixture(autouse=True)
def float64() -> object:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def layer(top_k: int = 8, ssmax: bool = False, seed: int = 0) -> DocRoutedSparseAttention:
    torch.manual_seed(seed)
    return DocRoutedSparseAttention(16, 4, 2, 8, top_k=top_k, pool=3, ssmax=ssmax).double()


def inputs(seed: int = 1, b: int = 2, m: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(LENS), 16, generator=g), torch.randn(b, m, 16, generator=g)


def reference(
    mod: DocRoutedSparseAttention, docs: torch.Tensor, hq: torch.Tensor, chosen: list[int]
) -> torch.Tensor:
    """Dense attention written out by hand: per-document RoPE and pooling, explicit softmax."""
    pooled_k, pooled_v, start = [], [], 0
    for doc, g in enumerate(LENS):
        h = docs[start : start + g]
        start += g
        if doc not in chosen:
            continue
        k = rope(mod.k_proj(h).view(g, mod.hkv, mod.d), torch.arange(g))
        v = mod.v_proj(h).view(g, mod.hkv, mod.d)
        for c in range(0, g, mod.pool):
            pooled_k.append(k[c : c + mod.pool].mean(0))
            pooled_v.append(v[c : c + mod.pool].mean(0))
    b, m, _ = hq.shape
    pos = torch.arange(len(chosen), len(chosen) + m)
    out = torch.zeros(b, m, mod.hq, mod.d)
    for i in range(b):
        q = rope(mod.q_proj(hq[i]).view(m, mod.hq, mod.d), pos)
        kq = rope(mod.k_proj(hq[i]).view(m, mod.hkv, mod.d), pos)
        vq = mod.v_proj(hq[i]).view(m, mod.hkv, mod.d)
        keys = torch.stack(pooled_k + list(kq)) if pooled_k else kq
        vals = torch.stack(pooled_v + list(vq)) if pooled_v else vq
        prefix = len(pooled_k)
        for h in range(mod.hq):
            kv = h // (mod.hq // mod.hkv)
            for t in range(m):
                n = prefix + t + 1
                s = keys[:n, kv] @ q[t, h] / math.sqrt(mod.d)
                if mod.ssmax_scale is not None and n > 1:
                    s = s * mod.ssmax_scale * math.log(n)
                out[i, t, h] = torch.softmax(s, 0) @ vals[:n, kv]
    return mod.o_proj(out.reshape(b, m, -1))


@pytest.mark.parametrize("ssmax", [False, True])
def test_dense_equivalence_forward_and_gradients(ssmax: bool) -> None:
    mod = layer(top_k=10, ssmax=ssmax)
    docs, hq = inputs()
    docs.requires_grad_(True)
    hq.requires_grad_(True)
    out, aux = mod(hq, mod.encode_docs(docs, LENS))
    assert aux["doc_idx"].tolist() == [[0, 1, 2, 3]] * 2
    ref = reference(mod, docs, hq, [0, 1, 2, 3])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    g1 = torch.autograd.grad(out.square().sum(), [docs, hq, mod.q_proj.weight, mod.k_proj.weight])
    g2 = torch.autograd.grad(ref.square().sum(), [docs, hq, mod.q_proj.weight, mod.k_proj.weight])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_no_documents_is_plain_causal_attention() -> None:
    mod = layer(top_k=0)
    docs, hq = inputs()
    out, aux = mod(hq, mod.encode_docs(docs, LENS))
    assert aux["doc_idx"].shape == (2, 0)
    torch.testing.assert_close(out, reference(mod, docs, hq, []), atol=1e-10, rtol=0)
    empty = mod.encode_docs(docs[:0], [])
    torch.testing.assert_close(mod(hq, empty)[0], out, atol=1e-12, rtol=0)


def test_selection_matches_brute_force_and_breaks_ties_by_lowest_id() -> None:
    mod = layer(top_k=2)
    docs, hq = inputs()
    bank = mod.encode_docs(docs, LENS)
    idx, scores = mod.route(hq, bank)
    scores, bank = scores.detach(), bank._replace(kr_bar=bank.kr_bar.detach())
    with torch.no_grad():
        qr = torch.nn.functional.normalize(mod.router_q(hq).view(2, 4, mod.hq, mod.d), dim=-1)
    for i in range(2):
        best = []
        for doc in range(len(LENS)):
            s_doc = -math.inf
            for c in range(int(bank.doc_ptr[doc]), int(bank.doc_ptr[doc + 1])):
                per_token = [
                    sum(float(qr[i, t, h] @ bank.kr_bar[c, h // 2]) for h in range(mod.hq)) / mod.hq
                    for t in range(4)
                ]
                s_doc = max(s_doc, max(per_token))
            best.append(s_doc)
            assert scores[i, doc].item() == pytest.approx(s_doc, abs=1e-12)
        want = sorted(sorted(range(len(LENS)), key=lambda d: (-best[d], d))[:2])
        assert idx[i].tolist() == want
    tied = bank._replace(kr_bar=torch.ones_like(bank.kr_bar) / math.sqrt(mod.d))
    assert mod.route(hq, tied)[0].tolist() == [[0, 1], [0, 1]]
    assert layer(top_k=99).route(hq, bank)[0].shape == (2, len(LENS))


def test_head_count_does_not_change_scores_when_heads_agree() -> None:
    one = DocRoutedSparseAttention(16, 1, 1, 8, top_k=2, pool=3).double()
    many = DocRoutedSparseAttention(16, 4, 2, 8, top_k=2, pool=3).double()
    with torch.no_grad():
        many.router_q.weight.copy_(one.router_q.weight.repeat(4, 1))
        many.router_k.weight.copy_(one.router_k.weight.repeat(2, 1))
    docs, hq = inputs()
    s1 = one.route(hq, one.encode_docs(docs, LENS))[1]
    s4 = many.route(hq, many.encode_docs(docs, LENS))[1]
    torch.testing.assert_close(s1, s4, atol=1e-12, rtol=0)


def test_unselected_documents_and_the_router_get_no_gradient_from_the_lm_loss() -> None:
    mod = layer(top_k=2)
    docs, hq = inputs(b=1)
    bank = mod.encode_docs(docs, LENS)
    leaf = bank._replace(
        k_bar=bank.k_bar.detach().requires_grad_(), v_bar=bank.v_bar.detach().requires_grad_()
    )
    out, aux = mod(hq, leaf)
    out.sum().backward()
    chosen = set(aux["doc_idx"][0].tolist())
    for doc in range(len(LENS)):
        rows = slice(int(leaf.doc_ptr[doc]), int(leaf.doc_ptr[doc + 1]))
        for grad in (leaf.k_bar.grad, leaf.v_bar.grad):
            assert grad is not None
            if doc in chosen:
                assert grad[rows].abs().sum() > 0
            else:
                assert torch.equal(grad[rows], torch.zeros_like(grad[rows]))
    assert mod.router_q.weight.grad is None and mod.router_k.weight.grad is None
    positives = torch.zeros(1, len(LENS), dtype=torch.bool)
    positives[0, 1] = True
    routing_aux_loss(aux["doc_scores"], positives, tau=0.1).backward()
    assert mod.router_q.weight.grad is not None and mod.router_q.weight.grad.abs().sum() > 0


def test_documentwise_rope_and_order_invariance() -> None:
    mod = layer(top_k=10)
    docs, hq = inputs()
    together = mod.encode_docs(docs, LENS)
    alone = mod.encode_docs(docs[5:12], [7])
    rows = slice(int(together.doc_ptr[1]), int(together.doc_ptr[2]))
    torch.testing.assert_close(together.k_bar[rows], alone.k_bar, atol=1e-12, rtol=0)
    order = [2, 0, 3, 1]
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    shuffled = torch.cat([docs[starts[d] : starts[d] + LENS[d]] for d in order])
    out1 = mod(hq, together)[0]
    out2 = mod(hq, mod.encode_docs(shuffled, [LENS[d] for d in order]))[0]
    torch.testing.assert_close(out1, out2, atol=1e-10, rtol=0)


def test_query_positions_start_at_k() -> None:
    mod = layer(top_k=2)
    docs, hq = inputs(b=1)
    bank = mod.encode_docs(docs, LENS)
    idx = torch.tensor([[0, 3]])
    torch.testing.assert_close(mod(hq, bank, idx)[0], reference(mod, docs, hq, [0, 3]), atol=1e-10, rtol=0)


def test_chunk_mean_with_a_ragged_last_chunk() -> None:
    x = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    pooled, owner, ptr = chunk_mean(x, [5, 2], 3)
    want = torch.stack([x[0:3].mean(0), x[3:5].mean(0), x[5:7].mean(0)])
    torch.testing.assert_close(pooled, want)
    assert owner.tolist() == [0, 0, 1] and ptr.tolist() == [0, 2, 3] and pooled.dtype == torch.float32


def test_ssmax_reduces_to_softmax_and_sharpens_monotonically() -> None:
    z = torch.randn(3, 9)
    n = 9
    torch.testing.assert_close(ssmax_softmax(z, 1 / math.log(n)), torch.softmax(z, -1), atol=1e-15, rtol=0)
    tops = [ssmax_softmax(z, s).amax(-1) for s in (0.5, 1.0, 2.0, 4.0)]
    for a, b in itertools.pairwise(tops):
        assert torch.all(b >= a - 1e-15)
    one = torch.tensor([[0.3, float("-inf")]])
    assert ssmax_softmax(one, 5.0).tolist() == [[1.0, 0.0]]
    lse, bias = torch.logsumexp(z, -1, keepdim=True), torch.tensor(0.7)
    with_sink = torch.exp(z) / (torch.exp(z).sum(-1, keepdim=True) + torch.exp(bias))
    torch.testing.assert_close(
        with_sink, torch.softmax(z, -1) * torch.sigmoid(lse - bias), atol=1e-15, rtol=0
    )


def test_raw_token_routing_equals_document_masked_dense_attention() -> None:
    g = torch.Generator().manual_seed(3)
    doc_of_key = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1, -1]])
    q = torch.randn(1, 4, 3, 8, generator=g)
    k = torch.randn(1, 2, 11, 8, generator=g)
    v = torch.randn(1, 2, 11, 8, generator=g)
    full = doc_sparse_attention(q, k, v, doc_of_key, torch.tensor([[0, 1, 2]]))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()[-3:]
    dense = torch.softmax(((q @ kk.transpose(-1, -2)) / 8**0.5).masked_fill(~causal, float("-inf")), -1) @ vv
    torch.testing.assert_close(full, dense, atol=1e-12, rtol=0)
    part = doc_sparse_attention(q, k, v, doc_of_key, torch.tensor([[2]]))
    keep = torch.tensor([5, 6, 7, 8, 9, 10])
    sub = doc_of_key[:, keep].clone()
    alone = doc_sparse_attention(q, k[:, :, keep], v[:, :, keep], sub, torch.tensor([[2]]))
    torch.testing.assert_close(part, alone, atol=1e-12, rtol=0)


@pytest.mark.parametrize("ssmax", [None, 0.6])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_attention_block_mask_equals_the_dense_reference(ssmax: float | None, causal: bool) -> None:
    import warnings

    from agents.learning.sparse_attention.flex import flex_doc_sparse_attention

    g = torch.Generator().manual_seed(5)
    b, hq, hkv, m, d = 2, 4, 2, 8, 16
    doc_of_key = torch.tensor([[0] * 40 + [1] * 24 + [2] * 50 + [3] * 30 + [-1] * 16,
                               [0] * 10 + [1] * 70 + [2] * 30 + [3] * 34 + [-1] * 16])  # fmt: skip
    length = doc_of_key.shape[1]
    q = torch.randn(b, hq, m, d, generator=g)
    k = torch.randn(b, hkv, length, d, generator=g)
    v = torch.randn(b, hkv, length, d, generator=g)
    per_head = torch.tensor([[[0, 2], [1, 3], [2, 2], [3, 0]], [[1, 1], [0, 3], [2, 1], [3, 2]]])
    for selected in (torch.tensor([[1, 3], [0, 2]]), per_head):
        ref = doc_sparse_attention(q, k, v, doc_of_key, selected, causal=causal, ssmax_scale=ssmax)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # eager flex on CPU warns that it is unfused
            out = flex_doc_sparse_attention(q, k, v, doc_of_key, selected, causal, ssmax, block_size=32)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
