"""Attention blocks for ring attention and document masking (kernels/attention_blocks.py).

The ring relies on one property: running attention_block_fwd over every key block and merging
with merge_attention gives the full attention's (out, lse), and summing attention_block_bwd over
the key blocks (given the merged out and lse) gives its gradients. test_ring_* check exactly
that; the other tests check each block op against its reference with the kernels' accuracy rule.
"""

import pytest
import torch
from megalite.kernels.attention import (
    _tile_lists,
    attention_masked,
    attention_masked_ref,
    attention_ref,
)
from megalite.kernels.attention_blocks import (
    attention_block_bwd,
    attention_block_bwd_ref,
    attention_block_fwd,
    attention_block_fwd_ref,
    merge_attention,
)

from tests.kernels.helpers import ATOL, assert_within, check_op, cuda_dtypes, make

INF = float("inf")


def _qkv(b, hq, hkv, sq, sk, d, dtype, device="cpu", grad=False):
    # q as the model lays it out ((b, s, hq, d) viewed as (b, hq, s, d)); v a strided slice.
    q = make((b, sq, hq * d), dtype, device).view(b, sq, hq, d).transpose(1, 2)
    k = make((b, hkv, sk, d), dtype, device)
    v = make((b, hkv, sk, d), dtype, device, noncontig=True)
    return (q, k, v) if grad else (q.detach(), k.detach(), v.detach())


def _balanced(chunk, cp, rank):
    """Positions a rank holds when the sequence is cut into 2cp chunks: chunks r and 2cp-1-r."""
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def _docs(*lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


R = torch.arange
DOCS = _docs(9, 14, 3, 11)  # 37 tokens in 4 documents
# name: (b, hq, hkv, d, q_pos, k_pos, q_doc, k_doc)
CASES = {
    "overlap": (1, 4, 2, 16, R(20, 39), R(5, 42), None, None),  # sq 19 != sk 37, partly seen
    "before": (1, 4, 1, 32, R(40, 47), R(0, 19), None, None),  # every key visible
    "after": (1, 4, 2, 16, R(0, 7), R(10, 29), None, None),  # no key visible
    "diagonal": (1, 4, 1, 16, R(37), R(37), None, None),
    "balanced": (1, 4, 2, 32, _balanced(9, 2, 0), _balanced(9, 2, 1), None, None),
    "balanced_diag": (1, 4, 1, 16, _balanced(9, 2, 1), _balanced(9, 2, 1), None, None),
    "docs": (1, 4, 2, 16, R(37), R(37), DOCS, DOCS),
    "docs_offdiag": (1, 4, 2, 32, R(19, 37), R(0, 19), DOCS[19:], DOCS[:19]),
    # Per batch row doc ids (b, s), shared positions (s,).
    "docs_per_row": (
        2,
        4,
        1,
        16,
        R(19),
        R(19),
        torch.stack([_docs(7, 12), _docs(3, 3, 13)]),
        torch.stack([_docs(7, 12), _docs(3, 3, 13)]),
    ),  # fmt: skip
    # Longer than the interpreter's 64-token tiles: full, partial and skipped tiles there too.
    "long_docs": (1, 2, 1, 16, R(150), R(150), _docs(64, 86), _docs(64, 86)),
    "long_balanced": (1, 2, 1, 16, _balanced(40, 2, 0), _balanced(40, 2, 1), None, None),
}


def _case(name, dtype, device="cpu"):
    b, hq, hkv, d, qp, kp, qd, kd = CASES[name]
    ids = [None if t is None else t.to(device) for t in (qp, kp, qd, kd)]
    return _qkv(b, hq, hkv, qp.shape[-1], kp.shape[-1], d, dtype, device), ids


def _f64(ts):
    return [t.double() for t in ts]


def _check_lse(lse, lse_t, lse_x, atol):
    # Rows that see no key are -inf in all three, and only those.
    assert torch.equal(lse.isneginf(), lse_x.isneginf()) and not lse.isnan().any()
    fin = lse_x.isfinite()
    if fin.any():
        assert_within("lse", lse[fin], lse_t[fin], lse_x[fin], atol)


def _check_block_fwd(name, dtype, device="cpu"):
    torch.manual_seed(0)
    qkv, ids = _case(name, dtype, device)
    out, lse = attention_block_fwd(*qkv, *ids)
    out_t, lse_t = attention_block_fwd_ref(*qkv, *ids)  # torch in the same dtype
    out_x, lse_x = attention_block_fwd_ref(*_f64(qkv), *ids)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == qkv[0].shape and lse.shape == qkv[0].shape[:3]
    assert_within("out", out, out_t, out_x, ATOL[dtype])
    _check_lse(lse, lse_t, lse_x, ATOL[dtype])
    assert not out[lse.isneginf()].any()  # rows with nothing visible are 0


def _final(qkv, ids, seed):
    """A realistic merged (out, lse) for the block's query rows: the block's own result merged
    with a random partial over other keys; a row that sees nothing here sees nothing at all in
    one case, so lse = -inf rows are covered. fp64, rounded to fp32 as the ring keeps them."""
    out, lse = attention_block_fwd_ref(*_f64(qkv), *ids)
    g = torch.Generator().manual_seed(seed)
    lse_o = torch.randn(lse.shape, generator=g, dtype=torch.float64) + 1
    lse_o[..., 0] = torch.where(lse[..., 0].isneginf(), -INF, lse_o[..., 0])
    out_o = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out, lse = merge_attention(out, lse, out_o.to(out.device), lse_o.to(out.device))
    return out.float(), lse.float()


def _check_block_bwd(name, dtype, device="cpu"):
    torch.manual_seed(0)
    qkv, ids = _case(name, dtype, device)
    out, lse = _final(qkv, ids, seed=1)
    dout = torch.randn(out.shape, dtype=torch.float64).to(device=device, dtype=dtype)
    grads = attention_block_bwd(*qkv, out, lse, dout, *ids)
    grads_t = attention_block_bwd_ref(*qkv, out, lse, dout, *ids)
    grads_x = attention_block_bwd_ref(*_f64(qkv), *_f64([out, lse, dout]), *ids)
    for name_, g, g_t, g_x, x in zip(("dq", "dk", "dv"), grads, grads_t, grads_x, qkv):
        assert g.dtype == torch.float32 and g.shape == x.shape
        assert_within(name_, g, g_t, g_x, ATOL[dtype])


@pytest.mark.parametrize("name", list(CASES))
def test_block_fwd(dtype, name):
    _check_block_fwd(name, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_block_bwd(dtype, name):
    _check_block_bwd(name, dtype)


def _ring(q, k, v, dout, chunk, cp, doc, a2a=1):
    """Ring attention by hand, one process: rank r holds the load-balanced chunks r and
    2cp-1-r; each rank merges the blocks of every rank's keys, then sums the block gradients.
    `a2a` > 1: a2a+p2p's ring, whose member p holds the chunks of cp ranks a2a*p .. +a2a-1.
    Returns the outputs, lse and gradients scattered back to sequence order."""
    out = torch.zeros_like(q, dtype=torch.float64)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64, device=q.device)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v))
    held = [torch.cat([_balanced(chunk, cp, a2a * p + a) for a in range(a2a)])
            for p in range(cp // a2a)]  # fmt: skip
    doc_of = (lambda p: None) if doc is None else (lambda p: doc[p])
    for mine in held:
        o_r = l_r = None
        for t in range(len(held)):  # the order a ring visits the blocks in does not matter
            theirs = held[t]
            args = (k[:, :, theirs], v[:, :, theirs], mine, theirs, doc_of(mine), doc_of(theirs))
            o_b, l_b = attention_block_fwd(q[:, :, mine], *args)
            o_r, l_r = (o_b, l_b) if o_r is None else merge_attention(o_r, l_r, o_b, l_b)
        out[:, :, mine], lse[:, :, mine] = o_r.double(), l_r.double()
        for theirs in held:
            args = (mine, theirs, doc_of(mine), doc_of(theirs))
            g = attention_block_bwd(
                q[:, :, mine], k[:, :, theirs], v[:, :, theirs], o_r, l_r, dout[:, :, mine], *args
            )
            dq[:, :, mine] += g[0].double()
            dk[:, :, theirs] += g[1].double()
            dv[:, :, theirs] += g[2].double()
    return out, lse, (dq, dk, dv)


def _full(q, k, v, dout, doc):
    """Single-device attention with autograd on the reference: out, lse, grads."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    pos = torch.arange(q.shape[2], device=q.device)
    out = (
        attention_ref(q, k, v) if doc is None else attention_masked_ref(q, k, v, pos, pos, doc, doc)
    )
    out.backward(dout)
    _, lse = attention_block_fwd_ref(q.detach(), k.detach(), v.detach(), pos, pos, doc, doc)
    return out.detach(), lse, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_ring_sum_is_full_attention_fp64(cp, docs):
    """The property the ring relies on, exactly (fp64 takes the reference path)."""
    torch.manual_seed(0)
    chunk = 5
    s = 2 * cp * chunk
    q, k, v = _qkv(2, 4, 2, s, s, 16, torch.float64)
    dout = torch.randn_like(q)
    doc = _docs(4, 9, 1, s - 14) if docs else None
    out, lse, grads = _ring(q, k, v, dout, chunk, cp, doc)
    out_x, lse_x, grads_x = _full(q, k, v, dout, doc)
    torch.testing.assert_close(out, out_x, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, lse_x, rtol=0, atol=1e-10)
    for g, g_x in zip(grads, grads_x):
        torch.testing.assert_close(g, g_x, rtol=0, atol=1e-10)


def _check_ring_kernels(dtype, device, b, hq, hkv, chunk, cp, d, docs, a2a=1):
    torch.manual_seed(0)
    s = 2 * cp * chunk
    q, k, v = _qkv(b, hq, hkv, s, s, d, dtype, device)
    dout = torch.randn(q.shape, dtype=torch.float64).to(device=device, dtype=dtype)
    doc = _docs(s // 3, 1, s - s // 3 - 1).to(device) if docs else None
    out, lse, grads = _ring(q, k, v, dout, chunk, cp, doc, a2a)
    # Torch's own error: the single-device reference in the same dtype.
    out_t, lse_t, grads_t = _full(q, k, v, dout, doc)
    out_x, lse_x, grads_x = _full(*_f64((q, k, v, dout)), doc)
    assert_within("out", out, out_t, out_x, ATOL[dtype])
    assert_within("lse", lse, lse_t, lse_x, ATOL[dtype])
    for name, g, g_t, g_x in zip(("dq", "dk", "dv"), grads, grads_t, grads_x):
        assert_within(name, g, g_t, g_x, ATOL[dtype])


def test_ring_with_kernels(dtype):
    """The same property through the Triton kernels, within the accuracy rule."""
    _check_ring_kernels(dtype, "cpu", 1, 4, 2, 5, 2, 16, docs=True)


def test_hierarchical_ring_with_kernels(dtype):
    """a2a+p2p at cp 4 = 2 x 2: ring members hold chunks {0, 7, 1, 6} and {2, 5, 3, 4} of 8
    (out of order, four runs each); the Triton blocks over them give full attention."""
    _check_ring_kernels(dtype, "cpu", 1, 4, 2, 3, 4, 16, docs=True, a2a=2)


def test_merge_handles_empty_rows():
    torch.manual_seed(0)
    o_a, o_b = torch.randn(2, 1, 4, 3, 8, dtype=torch.float64)
    l_a = torch.tensor([[[-INF, 0.5, -INF, 700.0]]], dtype=torch.float64).reshape(1, 4, 1)
    l_b = torch.tensor([[[1.5, -INF, -INF, 690.0]]], dtype=torch.float64).reshape(1, 4, 1)
    l_a, l_b = l_a.expand(1, 4, 3), l_b.expand(1, 4, 3)
    o_a[l_a.isneginf()] = 0  # as the block op returns empty rows
    o_b[l_b.isneginf()] = 0
    out, lse = merge_attention(o_a, l_a, o_b, l_b)
    assert not out.isnan().any()
    torch.testing.assert_close(out[:, 0], o_b[:, 0], rtol=0, atol=0)  # one side empty
    torch.testing.assert_close(lse[:, 0], l_b[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 1], o_a[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, 1], l_a[:, 1], rtol=0, atol=0)
    assert not out[:, 2].any() and lse[:, 2].isneginf().all()
    w = torch.sigmoid(torch.tensor(10.0, dtype=torch.float64))  # large lse: no overflow
    torch.testing.assert_close(out[:, 3], w * o_a[:, 3] + (1 - w) * o_b[:, 3])
    expected = 700 + torch.log1p(torch.exp(torch.tensor(-10.0, dtype=torch.float64)))
    torch.testing.assert_close(lse[:, 3], expected.expand(1, 3))


def test_causal_blocks_skip_masked_tiles():
    # Diagonal block of 64 tokens, 32 x 16 tiles: per query tile, the tiles wholly in the past
    # need no mask, the diagonal ones do, and those in the future are not visited at all.
    p = R(64)[None]
    cnt, idx = _tile_lists(p, p, None, None, 32, 16, 64, by_key=False)
    assert cnt.tolist() == [[[0, 2], [2, 2]]]  # (B, full/part, query tiles)
    assert idx[0, 1, 0, :2].tolist() == [0, 1] and idx[0, 1, 1, :2].tolist() == [2, 3]
    # Load-balanced chunks: the early chunk sees none of the late keys.
    qp, kp = _balanced(16, 2, 0)[None], _balanced(16, 2, 1)[None]  # 0-15, 48-63 vs 16-47
    cnt, _ = _tile_lists(qp, kp, None, None, 16, 16, 32, by_key=False)
    assert cnt.tolist() == [[[0, 2], [0, 0]]]
    # Documents: a tile of a later document skips the earlier one.
    doc = _docs(32, 32)[None]
    cnt, _ = _tile_lists(p, p, doc, doc, 32, 16, 64, by_key=True)  # per key tile
    assert cnt.tolist() == [[[0, 0, 0, 0], [1, 1, 1, 1]]]


@pytest.mark.parametrize("name", ["docs", "balanced_diag"])
def test_attention_masked(dtype, name):
    torch.manual_seed(0)
    b, hq, hkv, d, qp, kp, qd, kd = CASES[name]
    # A permuted, load-balanced sequence: every rank's tokens, one after the other.
    perm = torch.cat([_balanced(6, 3, r) for r in range(3)]) if name == "balanced_diag" else R(37)
    qd = None if qd is None else qd[perm]
    args = _qkv(b, hq, hkv, len(perm), len(perm), d, dtype, grad=True)
    check_op(
        lambda q, k, v: attention_masked(q, k, v, perm, perm, qd, qd),
        lambda q, k, v: attention_masked_ref(q, k, v, perm, perm, qd, qd),
        args,
    )


def test_attention_masked_causal_is_attention(dtype):
    torch.manual_seed(0)
    args = _qkv(1, 4, 2, 19, 19, 32, dtype, grad=True)
    check_op(lambda q, k, v: attention_masked(q, k, v, R(19), R(19)), attention_ref, args)
    q, k, v = args
    assert attention_masked(q, k, v, R(19), R(19)).stride() == q.stride()  # q's layout


def test_fallbacks_and_errors():
    torch.manual_seed(0)
    (q, k, v), ids = _case("overlap", torch.float64)
    with pytest.warns(UserWarning, match="attention_block_fwd: dtype torch.float64"):
        out, lse = attention_block_fwd(q, k, v, *ids)
    assert out.dtype == lse.dtype == torch.float64
    out_r, lse_r = attention_block_fwd_ref(q, k, v, *ids)
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r)
    q24, k24 = torch.randn(1, 2, 5, 24), torch.randn(1, 1, 5, 24)
    with pytest.warns(UserWarning, match="head dim 24"):
        attention_masked(q24, k24, k24, R(5), R(5))
    with pytest.raises(ValueError, match="both q_doc and k_doc"):
        attention_block_fwd(q, k, v, *ids[:2], R(19))
    with pytest.raises(ValueError, match="k_pos has shape"):
        attention_block_fwd(q, k, v, ids[0], R(36))


@pytest.mark.gpu
@cuda_dtypes()
@pytest.mark.parametrize("name", list(CASES))
def test_block_fwd_bwd_gpu(dtype, name):
    _check_block_fwd(name, dtype, "cuda")
    _check_block_bwd(name, dtype, "cuda")


@pytest.mark.gpu
@cuda_dtypes()
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_ring_with_kernels_gpu(dtype, docs):
    _check_ring_kernels(dtype, "cuda", 2, 8, 2, 300, 2, 64, docs)


@pytest.mark.gpu
@cuda_dtypes()
def test_hierarchical_ring_with_kernels_gpu(dtype):
    _check_ring_kernels(dtype, "cuda", 2, 8, 2, 150, 4, 64, docs=True, a2a=2)


@pytest.mark.gpu
@cuda_dtypes()
def test_attention_masked_gpu(dtype):
    torch.manual_seed(1)
    perm = torch.cat([_balanced(256, 2, r) for r in range(2)]).cuda()
    doc = _docs(100, 700, 1, 223).cuda()[perm]
    check_op(
        lambda q, k, v: attention_masked(q, k, v, perm, perm, doc, doc),
        lambda q, k, v: attention_masked_ref(q, k, v, perm, perm, doc, doc),
        _qkv(2, 8, 2, 1024, 1024, 128, dtype, "cuda", grad=True),
    )


def test_tile_lists_built_once_per_micro_batch(monkeypatch):
    # Finding 10 (issue 32): every layer and ring step of a micro-batch passes views of the same
    # (cp, s) index tensor; its tile lists are built once per (query block, key block, tiling),
    # not per layer, and again after the index is written in place.
    import importlib

    attn = importlib.import_module("megalite.kernels.attention")  # the package's name is the op
    built = []
    real = attn._tile_lists
    monkeypatch.setattr(attn, "_tile_lists", lambda *a: built.append(a[4:]) or real(*a))
    cp, chunk = 2, 40
    index = torch.stack([_balanced(chunk, cp, r) for r in range(cp)])  # (cp, 2 * chunk)
    q, k, v = _qkv(1, 2, 1, 2 * chunk, 2 * chunk, 16, torch.float32)
    me = 0

    def layer():
        for src in range(cp):  # one rank's ring, forward then backward
            out, lse = attention_block_fwd(q, k, v, index[me], index[src])
            attention_block_bwd(q, k, v, out, lse, out, index[me], index[src])

    layer()
    per_layer = len(built)
    assert per_layer > 0
    for _ in range(3):
        layer()
    assert len(built) == per_layer  # before: 4 x per_layer
    index[1, 0] = index[1, 0]  # an in-place write: the lists may be stale, so they are rebuilt
    layer()
    assert len(built) == 2 * per_layer
