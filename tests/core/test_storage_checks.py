"""Tensors the serving kernels cannot read or write as stored are refused by name: lazily negated views (the kernels read the raw bits), storage
shrunk under a view (reads and writes past it), expanded output buffers, and outputs that overlap
the inputs. Pure argument checks: they run before any kernel, on the CPU."""

from __future__ import annotations

import pytest
import torch

import sparse_mla as flash_mla
from sparse_mla.kvcache.index_convert import abs_indices_to_kvcache_indices_triton


def _shrunk(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.untyped_storage().resize_(4)
    return t


def _store_args():
    kc = torch.zeros(2, 4, 1, 656, dtype=torch.uint8)
    kv = torch.ones(1, 576, dtype=torch.bfloat16)
    return kv, torch.tensor([1]), kc


@pytest.mark.parametrize("which", ["kv", "slot_mapping"])
@pytest.mark.parametrize("how", ["negated", "shrunk"])
def test_store_refuses_unreadable_inputs(which, how):
    kv, slots, kc = _store_args()
    bad = {"kv": kv, "slot_mapping": slots}[which]
    bad = torch._neg_view(-bad) if how == "negated" else _shrunk(bad)
    args = {"kv": kv, "slot_mapping": slots, which: bad}
    before = kc.clone()
    with pytest.raises(ValueError, match=f"^{which}: "):
        flash_mla.quantize_and_store_kv(args["kv"], args["slot_mapping"], kc)
    assert torch.equal(kc, before)  # nothing written


def test_index_conversion_refuses_unreadable_tensors():
    ai = torch.arange(64, dtype=torch.int32).view(1, 1, 64)
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^abs_indices: its elements run"):
        flash_mla.abs_indices_to_kvcache_indices(_shrunk(ai), bt, 32)
    with pytest.raises(ValueError, match="^abs_indices: a lazily negated"):
        abs_indices_to_kvcache_indices_triton(torch._neg_view(-ai), bt, 32)
    for out, what in (
        (_shrunk(torch.zeros(1, 1, 64, dtype=torch.int32)), "its elements run"),
        (torch.zeros(1, 1, 1, dtype=torch.int32).expand(1, 1, 64), "its elements overlap"),
        (torch._neg_view(torch.zeros(1, 1, 64, dtype=torch.int32)), "a lazily negated"),
    ):
        with pytest.raises(ValueError, match=f"^out: {what}"):
            abs_indices_to_kvcache_indices_triton(ai, bt, 32, out)
    good = abs_indices_to_kvcache_indices_triton(ai, bt, 32, torch.empty(1, 1, 64, dtype=torch.int32))
    assert torch.equal(good, flash_mla.abs_indices_to_kvcache_indices(ai, bt, 32))


def test_combine_refuses_unreadable_or_overlapping_buffers():
    rows, b, s_q, h_q = 3, 1, 1, 4
    o_acc = torch.randn(rows, s_q, h_q, 512)
    l_acc = torch.randn(rows, s_q, h_q)
    ns = torch.tensor([0, 3], dtype=torch.int32)
    out = torch.empty(b, s_q, h_q, 512)
    lse = torch.empty(b, h_q, s_q)
    op = torch.ops.sparse_mla.combine
    with pytest.raises(ValueError, match="^o_accum: its elements run"):
        op(_shrunk(o_acc), l_acc, ns, out, lse)
    with pytest.raises(ValueError, match="^lse: must not overlap"):
        op(o_acc, l_acc, ns, out, l_acc[:1].permute(0, 2, 1))
    with pytest.raises(ValueError, match="^out: its elements overlap"):
        op(o_acc, l_acc, ns, torch.empty(1, 1, 1, 512).expand(b, s_q, h_q, 512), lse)
    op(o_acc, l_acc, ns, out, lse)  # the well-formed call runs
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
