"""Context-parallel decode: the LSE merge (against its twin and against one device holding all the
keys), and the decode over a cache sharded across 2-3 CPU processes (gloo) compared with the
single-device result on the same global cache."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import check_decode_close, make_problem

from sparse_mla.distributed import (
    localize_indices,
    merge_attention_states,
    merge_attention_states_reference,
    sparse_decode_context_parallel,
)
from sparse_mla.reference import sparse_decode_reference

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def test_merge_matches_twin_with_empty_and_nan_parts():
    g = torch.Generator().manual_seed(0)
    outs = torch.randn(3, 4, 5, 16, generator=g)
    lses = torch.randn(3, 4, 5, generator=g) * 3
    lses[0, 0, :] = float("inf")  # part 0 empty for row 0 (the decode's lonely convention)
    lses[:, 1, 0] = float("inf")  # every part empty
    lses[1, 2, 1] = float("-inf")  # an empty part marked -inf
    lses[2, 3, 2] = float("nan")
    outs[0, 0, :] = float("nan")  # an empty part's out is never read
    out, lse = merge_attention_states(outs, lses)
    ro, rl = merge_attention_states_reference(outs, lses)
    assert torch.equal(torch.isnan(out), torch.isnan(ro)) and torch.equal(torch.isnan(lse), torch.isnan(rl))
    torch.testing.assert_close(out, ro, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(lse, rl, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.isposinf(lse[1, 0]) and (out[1, 0] == 0).all() and torch.isfinite(out[0]).all()


def test_merge_of_disjoint_halves_is_the_whole_decode():
    p = make_problem(b=2, s_q=2, h_q=16, topk=128, layout="V32", num_blocks=4, seed=1)
    whole_o, whole_l = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512)
    mask = torch.rand(p.indices.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    halves = [torch.where(m, p.indices, torch.full_like(p.indices, -1)) for m in (mask, ~mask)]
    parts = [sparse_decode_reference(p.q, p.k_cache, ix, None, 512) for ix in halves]
    out, lse = merge_attention_states(
        torch.stack([o for o, _ in parts]), torch.stack([lv.permute(0, 2, 1) for _, lv in parts])
    )
    check_decode_close(out, lse.permute(0, 2, 1), whole_o, whole_l)


def test_merge_validates():
    with pytest.raises(ValueError, match="^outs, lses: expected"):
        merge_attention_states(torch.zeros(2, 3, 4), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="^lses: expected dtype"):
        merge_attention_states(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.float64))


def test_localize_indices():
    ix = torch.tensor([[[0, 5, 9, -1, 12, 7]]], dtype=torch.int32)
    assert localize_indices(ix, 5, 10).tolist() == [[[-1, 0, 4, -1, -1, 2]]]
    assert localize_indices(ix, 5, 10, torch.tensor([2], dtype=torch.int32)).tolist() == [[[-1, 0, -1, -1, -1, -1]]]


def _worker(rank, world, init_file, offsets_blocks, case):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p = make_problem(b=3, s_q=2, h_q=16, topk=96, layout=case["layout"], num_blocks=6, page_block_size=16, seed=7)
        pbs = p.k_cache.shape[1]
        idx = p.indices.clone()
        idx[2, 1] = -1  # a query with no valid key anywhere
        idx[1, 0, :50] = idx[1, 0, 50:100] = 5  # all its keys in block 0 (one rank)
        kw = {}
        if case["sink"]:
            kw["attn_sink"] = torch.tensor([0.5, float("inf"), float("-inf")] + [0.1] * 13)
        if case["topk_length"]:
            kw["topk_length"] = torch.tensor([96, 40, 0], dtype=torch.int32)
        ro, rl = sparse_decode_reference(p.q, p.k_cache, idx, None, 512, **kw)
        b0, b1 = offsets_blocks[rank], offsets_blocks[rank + 1]
        shard = p.k_cache[b0:b1] if b1 > b0 else p.k_cache[:1]  # an empty range still passes a (never read) block
        offsets = [o * pbs for o in offsets_blocks]
        out, lse = sparse_decode_context_parallel(p.q, shard, idx, offsets, **kw)
        check_decode_close(out, lse, ro, rl)
        assert torch.isposinf(lse[2, :, 1]).all() and (out[2, 1].float() == 0).all()
    finally:
        dist.destroy_process_group()


@needs_gloo
@pytest.mark.parametrize(
    "offsets_blocks, case",
    [
        ([0, 3, 6], dict(layout="V32", sink=False, topk_length=False)),
        ([0, 1, 1, 6], dict(layout="V32", sink=True, topk_length=True)),  # rank 1 owns nothing
        ([0, 4, 6], dict(layout="MODEL1", sink=True, topk_length=False)),
    ],
)
def test_context_parallel_decode_matches_one_device(offsets_blocks, case):
    world = len(offsets_blocks) - 1
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), offsets_blocks, case), nprocs=world, join=True)


def _disagreeing_worker(rank, world, init_file, case):
    # every rank must raise a ValueError naming the problem (before: gloo aborts, "connection
    # closed by peer", or a silently wrong merge when the ownership rules differed)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p = make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, page_block_size=16, seed=9)
        offsets = [0, 32, 64]
        kw = {}
        q = p.q
        if case == "offsets" and rank == 1:
            offsets = [0, 40, 64]
        if case == "sink" and rank == 0:
            kw["attn_sink"] = torch.zeros(1)  # the wrong shape on one rank only
        if case == "shape" and rank == 1:
            q = p.q[:, :, :8]
        shard = p.k_cache[:2] if rank == 0 else p.k_cache[2:]
        with pytest.raises(ValueError) as e:
            sparse_decode_context_parallel(q, shard, p.indices, offsets, **kw)
        expect = {"offsets": "the ranks must pass the same", "shape": "the ranks must pass the same"}
        if case == "sink":
            expect = "attn_sink: expected shape" if rank == 0 else "their arguments were refused"
        else:
            expect = expect[case]
        assert expect in str(e.value), str(e.value)
    finally:
        dist.destroy_process_group()


@needs_gloo
@pytest.mark.parametrize("case", ["offsets", "sink", "shape"])
def test_ranks_that_disagree_raise_on_every_rank(case):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_disagreeing_worker, args=(2, os.path.join(d, "init"), case), nprocs=2, join=True)


def test_not_initialised_raises():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(ValueError, match="^group: torch.distributed is not initialised"):
        sparse_decode_context_parallel(
            torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16), torch.zeros(1, 16, 1, 656, dtype=torch.uint8),
            torch.zeros(1, 1, 8, dtype=torch.int32), [0, 16],
        )  # fmt: skip


def test_merge_of_no_parts_is_refused():
    from sparse_mla.distributed import merge_attention_states
    from sparse_mla.distributed.merge import merge_attention_states_reference

    for fn in (merge_attention_states, merge_attention_states_reference):
        with pytest.raises(ValueError, match=r"R >= 1"):
            fn(torch.zeros(0, 4, 8), torch.zeros(0, 4))
