"""Context-parallel decode: the LSE merge (against its twin and against one device holding all the
keys), and the decode over a cache sharded across 2-3 CPU processes (gloo) compared with the
single-device result on the same global cache."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import check_decode_close, make_problem

from sparse_mla.distributed import decode as cp_decode
from sparse_mla.distributed import (
    localize_indices,
    merge_attention_states,
    merge_attention_states_reference,
    sparse_decode_context_parallel,
)
from sparse_mla.distributed.decode import _SIG_FIXED, _disagree, _int32_checksum
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


def _spawn(worker, world: int, *args) -> None:
    """Run ``worker(rank, world, init_file, *args)`` in ``world`` processes (a gloo group)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, os.path.join(d, "init"), *args), nprocs=world, join=True)


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
    _spawn(_worker, world, offsets_blocks, case)


def _disagreeing_worker(rank, world, init_file, case):
    # every rank must raise a ValueError naming the problem (not a gloo abort, "connection closed
    # by peer", nor a silently wrong merge when the ownership rules differ)
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
        expect = {
            "offsets": "slot_offsets: ranks disagree (rank 0: [0, 32, 64], rank 1: [0, 40, 64])",
            "shape": "q.shape: ranks disagree (rank 0: [2, 1, 16, 576], rank 1: [2, 1, 8, 576])",
        }
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
    _spawn(_disagreeing_worker, 2, case)


def _checksum_by_definition(values: list[int]) -> int:
    """The record's checksum in Python integers mod 2^64 (SplitMix64's finaliser on ``i << 32 | v``)."""
    m = (1 << 64) - 1
    total = 0
    for i, v in enumerate(values):
        z = ((i << 32) | (v & 0xFFFFFFFF)) ^ 0x9E3779B97F4A7C15
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        total = (total + (z ^ (z >> 31))) & m
    return total - (1 << 64) if total >= 1 << 63 else total


def test_int32_checksum_is_its_definition_and_sees_order_and_values():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-(2**31), 2**31 - 1, (2, 3, 40), generator=g, dtype=torch.int64).to(torch.int32)
    x[0, 0, :4] = torch.tensor([-1, 0, 2**31 - 1, -(2**31)], dtype=torch.int32)
    c = _int32_checksum(x)
    assert c.dtype == torch.int64 and c.dim() == 0
    assert c.item() == _checksum_by_definition(x.flatten().tolist())
    assert _int32_checksum(x[:, :, 1:]).item() == _checksum_by_definition(x[:, :, 1:].flatten().tolist())  # a view
    swapped = x.clone()
    swapped[1, 2, 0], swapped[1, 2, 1] = x[1, 2, 1], x[1, 2, 0]
    bumped = x.clone()
    bumped[0, 1, 7] += 1
    assert len({_int32_checksum(t).item() for t in (x, swapped, bumped)}) == 3
    assert _int32_checksum(torch.zeros(0, dtype=torch.int32)).item() == 0


def test_the_record_is_the_size_the_docstrings_say():
    assert _SIG_FIXED == 79  # words before the world_size + 1 slot offsets
    for doc in (cp_decode.__doc__, sparse_decode_context_parallel.__doc__):
        assert "(79 + world_size + 1) * 8" in doc and "656 B for two ranks" in doc


def test_disagreement_message_groups_the_ranks():
    assert _disagree("x", [1, 1]) is None
    assert _disagree("x", [1, 2, 1, 3]) == "x: ranks disagree (ranks 0, 2: 1, rank 1: 2, rank 3: 3)"


def _argument_worker(rank, world, init_file):
    # one process group, many calls: a call whose ranks disagree raises on every rank before the
    # data collective, so the next call starts clean
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p = make_problem(b=2, s_q=1, h_q=16, topk=64, num_blocks=4, page_block_size=16, seed=9)
        shard = p.k_cache[:2] if rank == 0 else p.k_cache[2:]
        zeros = torch.zeros(16)
        one_head = zeros.clone()
        one_head[3] = 0.5
        nan_head = zeros.clone()
        nan_head[0] = float("nan")
        lengths = torch.tensor([64, 10], dtype=torch.int32)
        flipped = p.indices.clone()
        flipped[1, 0] = flipped[1, 0].flip(-1)  # the same set of slots, in another order
        assert not torch.equal(flipped, p.indices)
        scale = 0.05
        # (what rank 0 passes, what rank 1 passes, the ValueError's text on every rank)
        cases = [
            (
                {},
                {"softmax_scale": scale},
                "softmax_scale: ranks disagree (rank 0: 0.041666666666666664, rank 1: 0.05)",
            ),
            ({"softmax_scale": scale}, {"softmax_scale": math.nextafter(scale, 1.0)}, "softmax_scale: ranks disagree"),
            (
                {"attn_sink": zeros},
                {"attn_sink": one_head},
                "attn_sink: ranks disagree (1 of 16 heads differ; attn_sink[3]: rank 0: 0.0, rank 1: 0.5)",
            ),
            (
                {"attn_sink": zeros},
                {"attn_sink": nan_head},
                "attn_sink: ranks disagree (1 of 16 heads differ; attn_sink[0]",
            ),
            ({}, {"attn_sink": zeros}, "attn_sink: ranks disagree (rank 0: None, rank 1: given)"),
            (
                {"topk_length": lengths},
                {"topk_length": lengths + 1},
                "topk_length: ranks disagree (rank 0: checksum 0x",
            ),
            ({"topk_length": lengths}, {}, "topk_length: ranks disagree (rank 0: given, rank 1: None)"),
            ({}, {"indices": flipped}, "indices: ranks disagree (rank 0: checksum 0x"),
            (
                {},
                {"k_cache": shard.view(torch.uint8)},
                "k_cache.dtype: ranks disagree (rank 0: torch.float8_e4m3fn, rank 1: torch.uint8)",
            ),
        ]
        for mine in cases:
            args = dict(q=p.q, k_cache=shard, indices=p.indices, slot_offsets=[0, 32, 64], backend="reference")
            args.update(mine[rank])
            with pytest.raises(ValueError) as e:
                sparse_decode_context_parallel(**args)
            assert mine[2] in str(e.value), (mine[2], str(e.value))
            assert str(e.value).endswith("(every rank must pass the same arguments)"), str(e.value)
        # a q dtype or head_dim_v the decode refuses: that rank raises its own error, every other
        # rank says which rank refused
        for bad, err, text in (
            ({"q": p.q.half()}, TypeError, "q: expected dtype torch.bfloat16"),
            ({"head_dim_v": 256}, ValueError, "head_dim_v: expected 512"),
        ):
            args = dict(q=p.q, k_cache=shard, indices=p.indices, slot_offsets=[0, 32, 64], backend="reference")
            if rank == 1:
                args.update(bad)
            with pytest.raises(err if rank == 1 else ValueError) as e:
                sparse_decode_context_parallel(**args)
            assert (text if rank == 1 else "rank(s) [1]: their arguments were refused") in str(e.value), str(e.value)
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_ranks_that_disagree_on_an_argument_raise_on_every_rank():
    _spawn(_argument_worker, 2)


def _agreeing_worker(rank, world, init_file):
    # arguments that are equal as the decode reads them: softmax_scale None and d_qk ** -0.5, NaN
    # sinks of other bit patterns, -0.0 and 0.0; the result is the one device's
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p = make_problem(b=2, s_q=2, h_q=16, topk=64, num_blocks=4, page_block_size=16, seed=11)
        sink = torch.linspace(-1.0, 1.0, 16)
        sink[2] = float("nan")
        sink[5] = 0.0
        lengths = torch.tensor([64, 23], dtype=torch.int32)
        ro, rl = sparse_decode_reference(p.q, p.k_cache, p.indices, None, 512, attn_sink=sink, topk_length=lengths)
        mine = sink.clone()
        scale = None
        if rank == 1:
            mine.view(torch.int32)[2] = -4194303  # 0xFFC00001: a negative NaN with a payload
            mine[5] = -0.0
            scale = 576**-0.5
        assert not torch.equal(mine.view(torch.int32), sink.view(torch.int32)) or rank == 0
        shard = p.k_cache[:2] if rank == 0 else p.k_cache[2:]
        out, lse = sparse_decode_context_parallel(
            p.q, shard, p.indices, [0, 32, 64], softmax_scale=scale, attn_sink=mine, topk_length=lengths,
            backend="reference",
        )  # fmt: skip
        check_decode_close(out, lse, ro, rl, finite=False)
        assert torch.isnan(out[:, :, 2].float()).all() and not torch.isnan(out[:, :, 3].float()).any()
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_ranks_that_agree_as_the_decode_reads_them_match_one_device():
    _spawn(_agreeing_worker, 2)


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
